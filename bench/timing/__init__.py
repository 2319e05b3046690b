"""The timing suites of `python -m bench`: time in interleaved rounds, peak memory, saved bytes, bytes moved.

logits_suite.py   the loss from the logits (the tokens x V grid); inputs.py, providers.py: its problems and
                  implementations (ours, eager, torch.compile, Liger-Kernel)
linear_suite.py   the loss from hidden states and the LM head (N x D x V); linear.py: its problems and
                  implementations (ours in each schedule, materialized logits, TRL's and Liger-Kernel's heads)
parallel.py       vocabulary-parallel: bytes per token, 2 gloo ranks against 1 process
replay.py         replaying recorded kept sets (sampling_mask) against the full vocabulary, with bytes moved
runner.py         interleaved rounds, the load and the rule that flags a ratio unreliable, saved bytes
memory.py         peak memory (CUDA allocator; on the CPU a fresh child process per implementation)
traffic.py        bytes the Triton kernels move, counted in Triton's interpreter
report.py, plots.py  the stdout tables and the PNG plots
"""
