"""The README's figures, generated from committed results files (so they are what the code printed).

    python scripts/readme_results.py record RUN_DIR --wall-seconds S   # docs/results/default-run.json from a run
    python scripts/readme_results.py write                             # rewrite the README's generated blocks
    python scripts/readme_results.py check                             # exit 1 when the README disagrees

The README holds generated blocks between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->``;
NAME.json in docs/results/ is the source of each (``default-run``: `topoclip train`'s eval.json plus
how it was run; ``compare``: what `topoclip compare` wrote). tests/test_readme_results.py runs `check`.
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
README = ROOT / "README.md"


def default_run_table(results: dict) -> str:
    """Markdown: one row per zero-shot set ("distance" mode) and per retrieval set of the default run."""
    lines = [f"Measured: `{results['command']}` on {results['machine']}, {results['wall_seconds'] / 60:.1f} minutes "
             f"in all (evaluation included), torch {results['torch']}.", "",
             "| set | domain | top-1 | top-5 | chance (top-1) |", "|---|---|---|---|---|"]
    for item in results["records"]:
        metrics = item["metrics"]
        if item["task"] == "zeroshot_classification" and metrics.get("mode") == "distance":
            lines.append(f"| {item['dataset']} | {item.get('domain', '')} | {metrics['top1']:.1f} | {metrics['top5']:.1f} "
                         f"| {100 / metrics['classes']:.1f} |")
    lines += ["", "| retrieval set | domain | image R@1 | text R@1 | mean recall |", "|---|---|---|---|---|"]
    for item in results["records"]:
        metrics = item["metrics"]
        if item["task"] == "zeroshot_retrieval":
            lines.append(f"| {item['dataset']} | {item.get('domain', '')} | {metrics['image_retrieval_recall@1']:.1f} "
                         f"| {metrics['text_retrieval_recall@1']:.1f} | {metrics['mean_recall']:.1f} |")
    if "temperature" in results:
        lines += ["", f"Final {results['temperature']}."]
    return "\n".join(lines)


def compare_table(results: dict) -> str:
    """Markdown of `topoclip compare`'s JSON: the table it wrote, and how it was run."""
    return (f"Measured: `{results['command']}` ({len(results['seeds'])} seeds) on {results['machine']}.\n\n"
            + results["table"])


RENDERERS = {"default-run": default_run_table, "compare": compare_table}


def render_blocks(readme: str) -> str:
    """The README with every generated block rewritten from its results file."""
    def replace(match: re.Match) -> str:
        name = match.group(1)
        results = json.loads((RESULTS / f"{name}.json").read_text())
        return f"<!-- results:{name} -->\n{RENDERERS[name](results)}\n<!-- /results:{name} -->"

    return re.sub(r"<!-- results:([\w-]+) -->.*?<!-- /results:\1 -->", replace, readme, flags=re.S)


def record(run_dir: Path, wall_seconds: float, command: str) -> Path:
    """docs/results/default-run.json from a finished run folder."""
    import torch

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = [m for m in metrics if "t" in m][-1]
    results = {"command": command, "wall_seconds": wall_seconds, "torch": torch.__version__.split("+")[0],
               "machine": f"{platform.machine()}, {torch.get_num_threads()} threads (the 2-core development machine)",
               "temperature": f"τ = {last['scale']:.2f} (t = {last['t']:.3f})",
               "records": json.loads((run_dir / "eval.json").read_text())}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "default-run.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    recorder = commands.add_parser("record", help="docs/results/default-run.json from a run folder")
    recorder.add_argument("run_dir", type=Path)
    recorder.add_argument("--wall-seconds", type=float, required=True, help="the whole command's wall time")
    recorder.add_argument("--as-command", default="topoclip train", help="the command that made the run")
    commands.add_parser("write", help="rewrite the README's generated blocks")
    commands.add_parser("check", help="exit 1 when the README's blocks differ from the results files")
    args = parser.parse_args()
    if args.command == "record":
        print(f"wrote {record(args.run_dir, args.wall_seconds, args.as_command)}")
        return 0
    current = README.read_text()
    wanted = render_blocks(current)
    if args.command == "write":
        README.write_text(wanted)
        return 0
    if wanted != current:
        print("README.md's generated blocks differ from docs/results/*.json; run: python scripts/readme_results.py write")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
