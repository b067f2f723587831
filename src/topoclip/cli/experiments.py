"""`topoclip ablate` and `compare`: experiments that train many runs."""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from topoclip.cli.common import add_command
from topoclip.core.arguments import add_overrides, whole


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
    from topoclip.experiments.runner import add_ablate_arguments

    ablate = add_command(commands, "ablate", command_ablate, "train a named grid of presets × settings × seeds "
                         "(resumable) and tabulate it like the paper's Table 6")
    add_ablate_arguments(ablate)


def command_compare(args) -> int:
    from topoclip.experiments.compare import compare

    compare(args.out, seeds=args.seeds, steps=args.steps, overrides=args.overrides, jobs=args.jobs, preset=args.preset,
            command=recorded_command())
    return 0


def add_compare(commands) -> None:
    compare = add_command(commands, "compare", command_compare, "train the default multi-token model and its sphere "
                          "baseline under the same recipe for N seeds (resumable) and compare them, mean ± std")
    compare.add_argument("--seeds", type=whole(2), default=3, help="seeds per model (default 3; at least 2, for Welch's t)")
    compare.add_argument("--steps", type=whole(1), help="train.steps of every run (default: the presets')")
    compare.add_argument("--jobs", type=whole(1), default=1, help="runs trained at once, each in its own process")
    compare.add_argument("--preset", help="a product-sphere preset, trained against the one-token sphere of its whole "
                         "dimension (e.g. tiny for a smoke test); default cpu-multi against cpu-sphere")
    compare.add_argument("--out", default="compare", help="output folder (default ./compare); re-running it "
                         "finishes what is missing")
    add_overrides(compare)


def command_report(args) -> int:
    from topoclip.experiments.results.documents import command

    return command(args.report, args)


def add_report(commands) -> None:
    from topoclip.experiments.results.documents import add_arguments

    report = add_command(commands, "report", None, "the documents' figures, generated from the results files in "
                         "docs/results (in a checkout): write them, check them, land an ablation, record a run")
    reports = report.add_subparsers(dest="report", required=True)
    add_arguments(reports)
    for sub in reports.choices.values():
        sub.set_defaults(run=command_report)
