"""What pulls a hyperbolic run's curvature at its final weights: the loss's two parts and each one's derivative in log c.

    python scripts/curvature_pull.py --batches 8 X/lorentz-19200-*/runs/*/seed-* > docs/results/lorentz-curvature-pull-19200.json

c is clamped after every step to [c₀/10, 10·c₀] (MERU's interval). A run whose c sits on a bound has stopped
learning it, and the derivatives say which part of the loss holds it there: a positive ∂/∂log c is a pull towards a
smaller c (gradient descent lowers log c), a flatter space. Each part is the trainer's (`contrastive_loss`, and
`model.entailment`, MERU's entailment loss unweighted, computed for a run trained without it too: what it would be),
on the first `--batches` training batches of the run's own data at its batch size, at its last checkpoint; the mean
over the batches, beside the share of pairs whose image lies outside its caption's cone (the hinge not 0).
Exploratory (issue #61): measured after the curvature's floor was seen, not pre-registered.
"""
import argparse
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Iterator

import torch

from topoclip.core.geometry import entailment_hinges
from topoclip.core.losses import loss_keywords
from topoclip.io.checkpoint import CHECKPOINTS, checkpoint_step, load_checkpoint, step_checkpoints
from topoclip.preprocess.tokenizer import TextBatch
from topoclip.run.training.data import prefetch_to_device, training_batches
from topoclip.run.training.step import contrastive_loss


def pull(model, batches: Iterable[tuple[torch.Tensor, TextBatch]], loss: str, keywords: dict) -> dict:
    """The mean over `batches` ((images, text) on the model's device) of each part of the loss and of its derivative
    in log c (`entailment` unweighted)."""
    if model.curvature is None:
        raise ValueError(f"{model.config.topology} has no curvature (only the hyperbolic topologies do)")
    if not model.curvature.log_c.requires_grad:
        raise ValueError("this model's c is not learned (model.curvature.learnable=false): nothing pulls it")
    values: dict[str, list[float]] = {name: [] for name in ("contrastive", "entailment", "contrastive_pull",
                                                           "entailment_pull", "outside")}
    for images, text in batches:
        out = model(images, text)
        parts = {"contrastive": contrastive_loss(model, out.image_embeds, out.text_embeds, out.scale, out.bias, loss,
                                                 False, keywords, 0.0, out.curvature),
                 "entailment": model.entailment(out.text_embeds, out.image_embeds, out.curvature)}
        for name, value in parts.items():
            (gradient,) = torch.autograd.grad(value, model.curvature.log_c, retain_graph=True)
            values[name].append(float(value.detach()))
            values[f"{name}_pull"].append(float(gradient))
        hinges = entailment_hinges(model.config.topology, out.text_embeds.detach(), out.image_embeds.detach(),
                                   out.curvature.detach())
        values["outside"].append(float((hinges > 0).double().mean()))  # each factor of a product a pair
    return {"c": float(model.curvature_value.detach()), "c_floor": math.exp(model.curvature.log_range[0]),
            **{name: sum(seen) / len(seen) for name, seen in values.items()}}


def training_start(config, tokenizer, count: int) -> Iterator[tuple[torch.Tensor, TextBatch]]:
    """The run's first `count` training batches, normalised and tokenized as the trainer gives them."""
    stream = prefetch_to_device(training_batches(config, 0), torch.device("cpu"), config.model.vision.mean,
                                config.model.vision.std)
    for batch in itertools.islice(stream, count):
        yield batch.images, batch.text if batch.text is not None else tokenizer(batch.captions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="finished run folders (RUN/checkpoints/step-N at the end)")
    parser.add_argument("--batches", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = []
    for run in args.runs:
        final = step_checkpoints(run / CHECKPOINTS)[-1]
        model, tokenizer, config = load_checkpoint(final)
        if checkpoint_step(final) != config.train.steps:
            raise SystemExit(f"{run}: its last checkpoint is {final.name}, not step {config.train.steps}")
        batches = training_start(config, tokenizer, args.batches)
        runs.append({"cell": run.parent.name, "seed": config.train.seed, "step": config.train.steps,
                     "weight": config.train.entailment_weight,
                     **pull(model, batches, config.train.loss, loss_keywords(config))})
        print(f"{run.parent.name} seed {config.train.seed}: c {runs[-1]['c']:.3f}", file=sys.stderr)
    seen = [(run["cell"], run["step"], run["seed"]) for run in runs]
    if len(set(seen)) < len(seen):
        raise SystemExit("a run is given twice (the same cell, steps and seed): each seed of a cell once")
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()  # -dirty: the tree differed from the commit
    print(json.dumps({"command": f"python scripts/curvature_pull.py --batches {args.batches} RUN...",
                      "commit": commit, "batches": args.batches, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
