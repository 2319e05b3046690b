"""`python -m bench.memory`: the logits suite's peak-memory child process (bench/timing/memory.py)."""
from bench.timing.memory import main

if __name__ == "__main__":
    main()
