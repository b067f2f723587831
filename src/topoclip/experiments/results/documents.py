"""The documents (README.md, docs/*.md, docs/results/*.md) and their generated blocks: which table draws a block
(RENDERERS, SUFFIX_RENDERERS), rewriting or checking them all, and the command line (`topoclip report`)."""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from topoclip.core.door import read_text
import topoclip.experiments.results.files as files
from topoclip.experiments.results.benchmarks import (csv_rows_table, fsdp_memory_table, gpu_check_table, gpu_feeding_table,
                                                     gpu_hyperbolic_table, loader_table, lora_table, meru_equality_table,
                                                     topology_cost_table)
from topoclip.experiments.results.files import land, load_result, pack, record
from topoclip.experiments.results.grids import (ablation_table, ceiling_table, compare_table, curvature_pull_table,
                                                default_run_table, equilibrium_table, experts_table,
                                                false_negatives_table, hierarchy_table, pilot_table, plot_grid,
                                                similarities_table)
from topoclip.experiments.results.headline import (drawn_from, fingerprint, headline_points, headline_table,
                                                   plot_headline)
from topoclip.experiments.results.tables import (LR_CHOICE, claims_summary_table, claims_table, comparison_table,
                                                 convergence_table, equivalence_table, lr_choice_table,
                                                 rerun_check_table, reruns_table, retrieval_table, stability_table,
                                                 tau_late_rise, tau_late_rise_table)


# The documents with generated blocks: the front door, the docs, the report.
DOCUMENTS = (files.README, *files.listed(files.ROOT / "docs", (".md",)), *files.listed(files.RESULTS, (".md",)))


RENDERERS = {"default-run": default_run_table, "csv-rows": csv_rows_table, "compare": compare_table, "claims": claims_table,
             "claims-summary": claims_summary_table, "headline": headline_table,
             "experts": experts_table, "equilibrium": equilibrium_table,
             "equilibrium-train": equilibrium_table, "similarities": similarities_table,
             "collapse": similarities_table, "false-negatives": false_negatives_table, "ceiling": ceiling_table,
             "ceiling-hard": ceiling_table, "hard-task-pilot": pilot_table, "tau-late-rise": tau_late_rise_table,
             "gpu-check": gpu_check_table, "gpu-feeding": gpu_feeding_table, "gpu-hyperbolic": gpu_hyperbolic_table,
             "fsdp-memory": fsdp_memory_table, "loader": loader_table,
             "topology-cost": topology_cost_table, "meru-equality": meru_equality_table, "lora": lora_table,
             "lorentz-hierarchy": hierarchy_table, "lorentz-curvature-pull": curvature_pull_table}


# A block named by a spec file's suffix (docs/results/NAME-SUFFIX.json) is that kind of table.
SUFFIX_RENDERERS = {"-tests": comparison_table, "-equivalence": equivalence_table, "-retrieval": retrieval_table,
                    "-convergence": convergence_table, "-reruns": reruns_table, "-stability": stability_table,
                    "-rerun-check": rerun_check_table}


def load_results(name: str):
    """The results block NAME draws from: computed from several files (τ's late rise, the headline, each family's lr,
    the claims' summary), else its file (files.load_result)."""
    if name == "tau-late-rise":  # computed from every grid's curves
        return tau_late_rise()
    if name == "headline":  # computed from the grids of HEADLINE
        return headline_points()
    if name.startswith(LR_CHOICE):  # the pre-registered choice of each family's lr, from the grid after the prefix
        grid = name.removeprefix(LR_CHOICE)
        final = files.RESULTS / f"{grid}-final-validation.json"
        return {**load_result(grid), **({"final_validation": files.read_results(final)} if final.is_file() else {})}
    if name == "claims-summary":
        return files.read_results(files.RESULTS / "claims.json")
    return load_result(name)


def renderer_for(name: str):
    """The function that draws block NAME: the lr rule's table for lr-choice-GRID, a spec file's kind by its suffix,
    a named table (a grid's steps suffix aside), else the grid's own table."""
    if name.startswith(LR_CHOICE):
        return lr_choice_table
    suffix = next((s for s in SUFFIX_RENDERERS if name.endswith(s)), None)
    return SUFFIX_RENDERERS[suffix] if suffix else RENDERERS.get(re.sub(r"-\d+$", "", name), ablation_table)


def render_blocks(readme: str) -> str:
    """The document with every generated block rewritten from its results file."""
    def replace(match: re.Match) -> str:
        name = match.group(1)
        results = load_results(name)
        return f"<!-- results:{name} -->\n{renderer_for(name)(results)}\n<!-- /results:{name} -->"

    return re.sub(r"<!-- results:([\w-]+) -->.*?<!-- /results:\1 -->", replace, readme, flags=re.S)


def refresh(write: bool) -> int:
    """`write`: rewrite every document's generated blocks and the headline figure; else check them (1: stale)."""
    stale = []
    for document in DOCUMENTS:
        current = read_text(document, "document", error=ValueError)
        wanted = render_blocks(current)
        if write:
            document.write_text(wanted)
            print(f"wrote {document.relative_to(files.ROOT)}")
        elif wanted != current:
            stale.append(document.relative_to(files.ROOT))
    figure = files.RESULTS / "headline.png"
    if write:
        print(f"wrote {plot_headline(headline_points(), figure).relative_to(files.ROOT)}")
    elif drawn_from(figure) != fingerprint(headline_points()):
        stale.append(figure.relative_to(files.ROOT))
    if stale:
        print(f"{', '.join(map(str, stale))}: generated blocks or figure differ from docs/results/; "
              f"run: topoclip report write")
        return 1
    return 0


def command(name: str, args) -> int:
    """One `topoclip report` command (record, land, plot, pack, write, check); 1 with one line on a refusal."""
    if name == "record":
        print(f"wrote {record(args.run_dir, args.wall_seconds, args.as_command)}")
        return 0
    if name == "land":
        try:
            landed = land(args.out, args.pool, args.replace)
        except (OSError, ValueError, KeyError) as error:
            print(f"land: {error}", file=sys.stderr)
            return 1
        print(f"wrote {landed.relative_to(files.ROOT)}" + (f", a part of {args.pool}" if args.pool else ""))
        return 0
    if name == "plot":
        print(f"wrote {plot_grid(args.grid, args.out)}")
        return 0
    if name == "pack":
        packed = pack(files.RESULTS)
        print(f"packed {len(packed)} results files (NAME.json.gz) in {files.RESULTS.relative_to(files.ROOT)}")
        return 0
    try:
        return refresh(name == "write")
    except (OSError, ValueError, KeyError, TypeError) as error:  # a results file damaged, missing, or not what it
        what = f"a results file lacks {error}" if isinstance(error, KeyError) else error  # should be
        print(f"{name}: {what}", file=sys.stderr)
        return 1


def add_arguments(commands) -> None:
    """The report's commands, as subcommands of `commands` (an argparse subparsers object)."""
    recorder = commands.add_parser("record", help="docs/results/default-run.json from a run folder")
    recorder.add_argument("run_dir", type=Path)
    recorder.add_argument("--wall-seconds", type=float, required=True, help="the whole command's wall time")
    recorder.add_argument("--as-command", default="topoclip train", help="the command that made the run")
    plotter = commands.add_parser("plot", help="draw a committed grid's validation curves (curves.png) into a folder")
    plotter.add_argument("grid", help="a folder of docs/results with an ablation.json, e.g. table3-lr1e-3-9600")
    plotter.add_argument("out", type=Path)
    lander = commands.add_parser("land", help="copy a finished ablation's ablation.json into docs/results/NAME/ "
                                               "(NAME: the folder's name)")
    lander.add_argument("out", type=Path, help="the --out folder of a finished `topoclip ablate`")
    lander.add_argument("--pool", help="the grid in parts (docs/results/POOL.json) this folder is a part of")
    lander.add_argument("--replace", action="store_true", help="replace docs/results/NAME when it holds other results")
    commands.add_parser("pack", help="gzip the ablation.json and per-run analysis files below docs/results (read as "
                        "before; keeps docs/results small)")
    commands.add_parser("write", help="rewrite the documents' generated blocks and draw docs/results/headline.png")
    commands.add_parser("check", help="exit 1 when a document's blocks or headline.png differ from the results files")


def main(argv=None) -> int:
    """The report's command line on its own (scripts/readme_results.py)."""
    parser = argparse.ArgumentParser(description="the documents' figures, generated from docs/results")
    add_arguments(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return command(args.command, args)
