"""`python -m topoclip ...` (also what `torchrun -m topoclip train ...` runs)."""
import sys

from topoclip.cli import main

if __name__ == "__main__":  # a fork server's worker imports this module too (topoclip.workers.worker_options)
    sys.exit(main())
