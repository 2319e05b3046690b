"""GTPO vs GRPO on a toy task with a fixed answer format, on the CPU.

Same as `python -m gtpo_kernels.demo`; see gtpo_kernels/demo.py for the task and the options.

    python examples/toy_rl.py            # writes toy_rl_out/toy_rl.json and toy_rl_out/toy_rl.png
"""
from gtpo_kernels.demo import main

if __name__ == "__main__":
    main()
