"""GTPO vs GRPO on a toy task with a fixed answer format (CPU, about a minute).

Same as `python -m gtpo_kernels.demo`; see gtpo_kernels/demo.py for the task and the options.

    python examples/toy_rl.py --out toy_rl_out
"""
from gtpo_kernels.demo import main

if __name__ == "__main__":
    main()
