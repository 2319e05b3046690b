"""The static GPU report (`python -m bench.aot`, no GPU needed): our vocabulary kernels compiled ahead of
time for sm_90, sm_80, sm_100 and gfx942 and counted (registers, spills, 16-byte loads, the main loop's
instructions per element, occupancy), with a roofline estimate per device; the kept-set replay kernels
for sm_90, sm_80 and sm_100 (registers, spills, instructions per kept element over their loops).

compiler.py  each kernel compiled as a real launch would be, then counted (ptxas -v, cuobjdump -sass)
sass.py      the SASS read: the main loop, occupancy, the roofline model and its device constants
amd.py       the same counts on gfx942's AMDGCN
peers.py     the peers' kernels (Liger-Kernel, TRL) compiled and counted the same way, when installed
tables.py    the tables, the JSON records and the files written
replay.py    the kept-set replay kernels (replay_triton): their records (aot-replay.json) and docs table
tune.py      BLOCK_V x warps: the static model's choice, and their timing on a GPU (`python -m bench.aot.tune`)
"""
from .compiler import DTYPES, T_REAL, AotResult, compile_kernel, report, report_in_subprocess  # noqa: F401
from .sass import ARCHS, DEVICES, V_REAL, arch_name  # noqa: F401
from .tables import arch_rows, format_roofline, format_table, records, summary_line, write_results  # noqa: F401
