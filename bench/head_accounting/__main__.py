"""python -m bench.head_accounting: see measure.py; with --replay, replay.py (the head over the sampler's kept
sets next to the full head, its own options)."""
import sys

from .measure import main

if __name__ == "__main__":
    if "--replay" in sys.argv[1:]:
        from .replay import main as replay_main
        replay_main([a for a in sys.argv[1:] if a != "--replay"])
    else:
        main()
