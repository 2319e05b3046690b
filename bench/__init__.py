"""Benchmarks of gtpo-kernels against the eager baseline, torch.compile, TRL and Liger-Kernel.

    python -m bench                          # the timing suites (CPU-sized default; CUDA: --gpu-sizes)
    python -m bench --suite linear --linear-size 4096,1024,32000   # from hidden states at a larger point
    python -m bench --help
    python -m bench.aot                      # the static GPU report, no GPU needed
    python -m bench.head_accounting          # the LM head's work outside its kernels, counted
    python -m bench.readme_numbers           # the README's tables against their committed JSON

One subpackage per tool: timing/ (the suites of `python -m bench`: logits, linear, parallel; time, peak
memory, saved bytes, bytes moved), aot/ (the static GPU report), head_accounting/ (the LM head's
accounting), common/ (where results go, their stamp, the clean-tree rule). results/ holds the committed
record (written with --save, only from a clean tree); out/ every other run (git-ignored); gpu_check.sh
is the check to run on a CUDA machine. parallel.py and memory.py keep `python -m bench.parallel` and
`python -m bench.memory` (the logits suite's memory child) working.
"""
