"""The documents' figures, generated from docs/results: `topoclip report`'s commands (topoclip.experiments.results).

    python scripts/readme_results.py write | check | land OUT [--pool POOL] | plot GRID OUT | record RUN --wall-seconds S
"""
import sys

from topoclip.experiments.results.documents import main

if __name__ == "__main__":
    sys.exit(main())
