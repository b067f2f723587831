"""Are two run folders the same run? eval.json, metrics.jsonl (timings aside) and the final weights, bit for bit.

    python scripts/same_run.py RUN_A RUN_B      # exit 0 when identical, 1 with the first difference

For refactors that must not change behaviour: train the same command before and after (same machine, same
thread count: the order of float sums depends on it) and compare the folders.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.torch import load_file

TIMINGS = {"images_per_s", "time", "seconds", "elapsed"}  # logged keys that measure the machine, not the run


def metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if k not in TIMINGS} for row in rows]


def final_weights(run: Path) -> dict:
    newest = sorted((run / "checkpoints").glob("step-*"))[-1]
    return {name: tensor for path in sorted(newest.glob("*.safetensors")) for name, tensor in load_file(path).items()}


def difference(a: Path, b: Path) -> str:
    """The first difference between the two runs, or "" when they are the same run."""
    if json.loads((a / "eval.json").read_text()) != json.loads((b / "eval.json").read_text()):
        return "eval.json differs"
    for step, (x, y) in enumerate(zip(metrics(a), metrics(b))):
        if x != y:
            return f"metrics.jsonl line {step + 1} differs: {sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))}"
    if len(metrics(a)) != len(metrics(b)):
        return "metrics.jsonl lengths differ"
    wa, wb = final_weights(a), final_weights(b)
    if wa.keys() != wb.keys():
        return f"weights differ in names: {sorted(wa.keys() ^ wb.keys())[:3]}"
    for name in wa:
        if not (wa[name].dtype == wb[name].dtype and wa[name].shape == wb[name].shape and wa[name].equal(wb[name])):
            return f"weight {name} differs"
    return ""


if __name__ == "__main__":
    found = difference(Path(sys.argv[1]), Path(sys.argv[2]))
    print(found or f"the same run: eval.json, metrics.jsonl (timings aside) and {len(final_weights(Path(sys.argv[1])))} "
                   f"weight tensors are identical")
    sys.exit(1 if found else 0)
