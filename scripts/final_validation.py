"""Each finished run of an ablation folder evaluated on the validation split with its final weights.

    python scripts/final_validation.py X/hard-lr-9600 > docs/results/hard-lr-9600-final-validation.json

For runs trained before the trainer evaluated the validation split at the last step too: their last periodic
evaluation is one `train.eval_every` short of the end. The pre-registered lr rule
(docs/results/preregistration-hard-task.md) reads validation "at the end of the schedule"; this gives it, with the
same sets and code as a periodic evaluation (the "val" split at evaluate.validation_size images per set).
"""
import json
import subprocess
import sys
from pathlib import Path

import torch

from topoclip.io.checkpoint import CHECKPOINTS, checkpoint_step, load_checkpoint, step_checkpoints
from topoclip.run.evaluation.run import evaluate, headline


def main(folder: str) -> None:
    runs = []
    for run in sorted(Path(folder).glob("runs/*/seed-*")):
        if not (run / "eval.json").is_file():
            raise SystemExit(f"{run} has not finished (no eval.json); finish the grid first")
        final = step_checkpoints(run / CHECKPOINTS)[-1]
        model, tokenizer, config = load_checkpoint(final)
        if checkpoint_step(final) != config.train.steps:
            raise SystemExit(f"{run}: its last checkpoint is {final.name}, not step {config.train.steps}")
        records = evaluate(model, tokenizer, config, "val", "cpu")
        runs.append({"cell": run.parent.name, "seed": config.train.seed, "step": config.train.steps,
                     "eval": headline(records)})
        print(f"{run.parent.name} seed {config.train.seed}: validation mean recall "
              f"{runs[-1]['eval']['scenes-val/mean_recall']:.2f}", file=sys.stderr)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    print(json.dumps({"command": f"python scripts/final_validation.py X/{Path(folder).name}", "split": "val",
                      "commit": commit, "threads": torch.get_num_threads(), "runs": runs}, separators=(",", ":")))


if __name__ == "__main__":
    main(sys.argv[1])
