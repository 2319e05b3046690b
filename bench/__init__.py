"""Microbenchmarks of gtpo-kernels against the eager baseline, torch.compile and Liger-Kernel.

    python -m bench                 # CPU-sized default; on a CUDA machine: python -m bench --gpu-sizes
    python -m bench --suite linear --linear-size 4096,1024,32000   # from hidden states, the README's CPU point
    python -m bench --help

Files: providers.py (one function per implementation), inputs.py (the problems and the reference
check), runner.py (time, peak memory, saved bytes), traffic.py (bytes moved, counted in Triton's
interpreter), aot.py (the static GPU report: registers, spills, 16-byte loads), plots.py, gpu_check.sh;
the `linear` suite (the loss from hidden states and the LM head): linear.py (inputs, implementations),
linear_suite.py (check, round-robin timing, peak memory, its table).
"""
