"""`python -m bench.parallel`: the vocabulary-parallel suite with its own options (bench/timing/parallel.py;
also `python -m bench --suite parallel`)."""
import sys

from bench.timing.parallel import main

if __name__ == "__main__":
    sys.exit(main())
