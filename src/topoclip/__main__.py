"""`python -m topoclip ...` (also what `torchrun -m topoclip train ...` runs)."""
import sys

from topoclip.cli import main

sys.exit(main())
