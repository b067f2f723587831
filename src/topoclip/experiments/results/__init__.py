"""The report: the figures of README.md, docs/*.md and docs/results/*.md, generated from the committed results files
in docs/results (`topoclip report write | check | land | plot | record`, or scripts/readme_results.py).

The documents hold generated blocks between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->``. The source of
each is in docs/results/: NAME.json (``default-run``: `topoclip train`'s eval.json plus how it was run; ``compare``:
what `topoclip compare` wrote; ``claims``: the paper's claims, which cells measure each, and our verdict;
{"parts": [...]}: a grid trained in parts, `files.pooled`), or NAME/ablation.json (what `topoclip ablate` wrote), or
NAME/*.json (``experts``, ``equilibrium``, ``similarities``, ``lorentz-hierarchy``: that `topoclip analyze` command on
each run).
tests/test_readme_results.py runs `check`.

By what it does: `files` (where the files are, reading, pooling, landing, recording), `grids` (a grid's and the
analyses' tables), `tables` (the tests a spec file asks for), `headline` (the headline's points, table and figure),
`benchmarks` (the benchmarks' tables), `documents` (the blocks, writing and checking them, the command line).
"""
from topoclip.experiments.results import benchmarks, documents, files, grids, headline, tables  # noqa: F401
from topoclip.experiments.results.benchmarks import *  # noqa: F401,F403
from topoclip.experiments.results.documents import *  # noqa: F401,F403
from topoclip.experiments.results.files import *  # noqa: F401,F403
from topoclip.experiments.results.grids import *  # noqa: F401,F403
from topoclip.experiments.results.headline import *  # noqa: F401,F403
from topoclip.experiments.results.tables import *  # noqa: F401,F403
from topoclip.experiments.results.documents import load_results  # noqa: F401  (the blocks' loader: special names too)
