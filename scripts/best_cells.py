"""Each model family's best cell of a one-seed grid, chosen on the validation split only.

    python scripts/best_cells.py X/lr-4800      # prints: multi_lr-1e-3 ps-16x8_lr-1e-3 sphere_lr-1e-3

The family is a cell name's first part (before "_"). Best = highest shape top-1 at the last validation
evaluation before the final (test) one, ties by validation retrieval mean recall. The printed cells go to
`topoclip ablate ... --seeds 3 --cells ...`.
"""
import json
import sys
from pathlib import Path


def main(folder: str) -> None:
    best = {}
    for run in sorted(Path(folder).glob("runs/*/seed-0")):
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        validation = [r for r in records if "eval" in r and not r.get("final")]
        if not validation:
            continue
        values = validation[-1]["eval"]
        key = (values["shape/distance/top1"], values["scenes-val/mean_recall"])
        cell = run.parent.name
        family = cell.split("_")[0]
        print(f"{cell}: step {validation[-1]['step']}, shape {key[0]:.1f}, retrieval {key[1]:.1f}", file=sys.stderr)
        if family not in best or key > best[family][0]:
            best[family] = (key, cell)
    print(" ".join(cell for _, cell in best.values()))


if __name__ == "__main__":
    main(sys.argv[1])
