"""What one call of the fused LM head does outside its kernels, counted on the CPU
(`python -m bench.head_accounting`; also `python -m bench --suite head`).

measure.py  the cases, each head set up on them, the measurement and the command line (its docstring
            defines every count)
counter.py  the TorchDispatchMode that counts (tile passes, host syncs, allocations, GEMM FLOPs)
table.py    the table, each cell 'before -> now' against an earlier result
replay.py   the head over the sampler's kept sets counted next to the full head (--replay)
"""
