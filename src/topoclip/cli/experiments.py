"""`topoclip ablate` and `compare`: experiments that train many runs."""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from topoclip.cli.common import add_command, add_overrides, whole


def recorded_command() -> str:
    """This command line as a results file records it: each absolute path becomes X/<its last part> (the README's
    "X is any folder"), so committed JSON names no folder of the machine that made it; quoted for a shell."""
    def portable(argument: str) -> str:
        option, equals, value = argument.rpartition("=") if argument.startswith("--") else ("", "", argument)
        return option + equals + (f"X/{Path(value).name}" if os.path.isabs(value) else value)

    return shlex.join(["topoclip"] + [portable(a) for a in sys.argv[1:]])


def command_ablate(args) -> int:
    from topoclip.experiments.runner import ablate

    out = Path(args.out or Path("ablations") / Path(args.grid).stem)
    args.on_interrupt = f"{out} keeps the runs it finished: run the same command to train the rest"
    ablate(args.grid, out, seeds=args.seeds, steps=args.steps, overrides=args.overrides, jobs=args.jobs,
           preset=args.preset, probe_size=args.probe_size, cells=args.cells, reuse=args.reuse or (),
           command=recorded_command(), first_seed=args.first_seed)
    return 0


def add_ablate(commands) -> None:
    from topoclip.experiments.grid import grid_names

    ablate = add_command(commands, "ablate", command_ablate, "train a named grid of presets × settings × seeds "
                         "(resumable) and tabulate it like the paper's Table 6")
    ablate.add_argument("--grid", required=True, help=f"{', '.join(grid_names())}, or a grid JSON file")
    ablate.add_argument("--seeds", type=whole(1), default=3, help="seeds per cell (default 3)")
    ablate.add_argument("--first-seed", type=whole(0), default=0, help="the first seed (default 0): --seeds 5 "
                        "--first-seed 5 trains seeds 5-9, five more seeds for a grid whose folder has 0-4")
    ablate.add_argument("--steps", type=whole(1), help="train.steps of every run (default: the presets')")
    ablate.add_argument("--jobs", type=whole(1), default=1, help="runs trained at once, each in its own process")
    ablate.add_argument("--preset", help="replace every cell's base preset (e.g. tiny for a smoke test)")
    ablate.add_argument("--cells", nargs="+", metavar="PATTERN", help="only the cells whose folder name matches one "
                        "of these shell patterns, e.g. 'sphere_*' 'ps-inner_*' (a reduced grid)")
    ablate.add_argument("--probe-size", type=whole(0), default=1000, help="training images of each run's linear probe "
                        "(0: no probe)")
    ablate.add_argument("--out", help="output folder (default ablations/GRID); re-running it finishes what is missing")
    ablate.add_argument("--reuse", nargs="+", metavar="OUT", help="other ablation folders (e.g. a compare run's): "
                        "their finished runs whose config equals a cell's (name aside) are copied instead of trained")
    add_overrides(ablate)


def command_compare(args) -> int:
    from topoclip.experiments.compare import compare

    compare(args.out, seeds=args.seeds, steps=args.steps, overrides=args.overrides, jobs=args.jobs, preset=args.preset,
            command=recorded_command())
    return 0


def add_compare(commands) -> None:
    compare = add_command(commands, "compare", command_compare, "train the default multi-token model and its sphere "
                          "baseline under the same recipe for N seeds (resumable) and compare them, mean ± std")
    compare.add_argument("--seeds", type=whole(1), default=3, help="seeds per model (default 3)")
    compare.add_argument("--steps", type=whole(1), help="train.steps of every run (default: the presets')")
    compare.add_argument("--jobs", type=whole(1), default=1, help="runs trained at once, each in its own process")
    compare.add_argument("--preset", help="replace both models' base preset (e.g. tiny for a smoke test)")
    compare.add_argument("--out", default="compare", help="output folder (default ./compare); re-running it "
                         "finishes what is missing")
    add_overrides(compare)
