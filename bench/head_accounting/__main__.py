"""python -m bench.head_accounting: see measure.py."""
from .measure import main

if __name__ == "__main__":
    main()
