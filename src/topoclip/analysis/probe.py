"""Linear probe on frozen image features (paper Tables 3/4 "Linear Probe").

Features: the m image class tokens after ``ln_post`` and before the projection, concatenated
(B, m·width) — the paper drops the projection head and concatenates the class-token features.
Classifier: multinomial logistic regression fitted full-batch with L-BFGS on standardised
features, the weight decay chosen from a small sweep by accuracy on a validation split. (The
paper trains its probe with SGD for 100 epochs on ImageNet; on a few thousand feature vectors the
convex problem is solved exactly by L-BFGS in seconds, which removes the learning-rate schedule as
a variable.)

Data: the built-in scenes' single-object classification sets — train split to fit, val split to
choose the weight decay, test split (in-domain and out-of-domain) to report top-1.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from topoclip.analysis.output import pyplot, save_figure, write_json
from topoclip.config import ConfigError
from topoclip.run.evaluation.zeroshot import evaluating
from topoclip.run.inference import Pretrained

WEIGHT_DECAYS = (0.0, 1e-4, 1e-3, 1e-2, 1e-1)
TASKS = ("shape", "colour", "composition")


def class_token_features(model, pixels: torch.Tensor) -> torch.Tensor:
    """pixels (B, 3, S, S) -> (B, m·width): the image class tokens after ln_post, before the projection (with
    attention pooling, SigLIP's, the m pooled tokens: the head's output, not ln_post's grid of patches)."""
    captured = {}
    pooled = model.visual.head if model.visual.attention_pooling else model.visual.ln_post
    handle = pooled.register_forward_hook(lambda module, args, output: captured.update(value=output))
    try:
        model.visual(pixels)
    finally:
        handle.remove()
    return captured["value"].flatten(1).float()


def extract_features(loaded: Pretrained, images: Sequence, batch_size: int = 256) -> torch.Tensor:
    """Images (uint8 arrays / PIL) -> (N, m·width) features on the CPU."""
    blocks = []
    with evaluating(loaded.model):
        for start in range(0, len(images), batch_size):
            pixels = loaded.pixels(images[start : start + batch_size])
            blocks.append(class_token_features(loaded.model, pixels).cpu())
    return torch.cat(blocks)


@dataclass
class LinearProbe:
    """A fitted linear classifier on standardised features: logits = ((x − mean) / std) @ weight.T + bias."""

    weight: torch.Tensor  # (C, D)
    bias: torch.Tensor  # (C,)
    mean: torch.Tensor  # (D,)
    std: torch.Tensor  # (D,)
    weight_decay: float
    validation_accuracy: float
    sweep: dict  # weight decay -> validation accuracy

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """(N, D) -> (N, C)."""
        return ((features - self.mean) / self.std) @ self.weight.T + self.bias

    def accuracy(self, features: torch.Tensor, labels: torch.Tensor) -> float:
        """Top-1 in percent."""
        return 100.0 * (self.logits(features).argmax(1) == labels).float().mean().item()


# Below this many multiply-adds per evaluation, the fit runs on one thread: its hundreds of small
# ops cost more in thread hand-offs than they gain (25× slower on two threads of a busy 2-core machine).
ONE_THREAD_BELOW = 2**24


@contextmanager
def _threads_for(work: int):
    before = torch.get_num_threads()
    if work < ONE_THREAD_BELOW:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def fit_logistic(features: torch.Tensor, labels: torch.Tensor, num_classes: int, weight_decay: float,
                 max_iterations: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimise mean cross-entropy + weight_decay/2 · ‖W‖² with L-BFGS -> (W (C, D), b (C,))."""
    weight = torch.zeros(num_classes, features.shape[1], requires_grad=True)
    bias = torch.zeros(num_classes, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], lr=1.0, max_iter=max_iterations, history_size=20,
                                  tolerance_grad=1e-9, tolerance_change=1e-12, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(features @ weight.T + bias, labels) + 0.5 * weight_decay * weight.square().sum()
        loss.backward()
        return loss

    with torch.enable_grad(), _threads_for(features.numel() * num_classes):
        optimizer.step(closure)
    return weight.detach(), bias.detach()


def train_linear_probe(train_features: torch.Tensor, train_labels: torch.Tensor, validation_features: torch.Tensor,
                       validation_labels: torch.Tensor, num_classes: int,
                       weight_decays: Sequence[float] = WEIGHT_DECAYS, max_iterations: int = 100) -> LinearProbe:
    """Fit one classifier per weight decay on train; keep the best on validation (the smaller decay on ties)."""
    mean = train_features.mean(0)
    std = train_features.std(0).clamp_min(1e-6)
    standardised = (train_features - mean) / std
    best, sweep = None, {}
    for decay in sorted(weight_decays):
        weight, bias = fit_logistic(standardised, train_labels, num_classes, decay, max_iterations)
        probe = LinearProbe(weight, bias, mean, std, decay, 0.0, sweep)
        probe.validation_accuracy = probe.accuracy(validation_features, validation_labels)
        sweep[decay] = probe.validation_accuracy
        if best is None or probe.validation_accuracy > best.validation_accuracy:
            best = probe
    return best


def task_sets(loaded: Pretrained, train_size: int, validation_size: int, test_size: int) -> dict[str, dict]:
    """The built-in labelled sets, rendered once: {"train" | "val" | "test": {set name: ClassificationSet}}.

    The test split also has the "-ood" copies (out-of-domain rendering style)."""
    from topoclip.data.scenes import classification_sets

    scenes = loaded.config.data.scenes
    sizes = {"train": train_size, "val": validation_size, "test": test_size}
    return {split: {s.name: s for s in classification_sets(scenes, split, size, include_out_of_domain=split == "test")}
            for split, size in sizes.items()}


def probe_task(loaded: Pretrained, task: str, sets: dict[str, dict], batch_size: int = 256) -> dict:
    """Fit and score the probe on one task -> {"test_top1", "test_ood_top1", "weight_decay", "sweep", …}."""
    train_set, validation_set, test_set = sets["train"][task], sets["val"][task], sets["test"][task]
    ood_set = sets["test"].get(task + "-ood")
    features = {name: extract_features(loaded, data.images, batch_size)
                for name, data in [("train", train_set), ("val", validation_set), ("test", test_set),
                                   ("test-ood", ood_set)] if data is not None}
    probe = train_linear_probe(features["train"], train_set.labels, features["val"], validation_set.labels,
                               len(train_set.classnames))
    result = {"classes": len(train_set.classnames), "feature_dim": features["train"].shape[1],
              "train_size": len(train_set.images), "validation_size": len(validation_set.images),
              "test_size": len(test_set.images), "weight_decay": probe.weight_decay,
              "validation_top1": probe.validation_accuracy,
              "train_top1": probe.accuracy(features["train"], train_set.labels),
              "test_top1": probe.accuracy(features["test"], test_set.labels), "sweep": probe.sweep}
    if ood_set is not None:
        result["test_ood_top1"] = probe.accuracy(features["test-ood"], ood_set.labels)
    return result


def plot_probe(result: dict, out_dir):
    """probe.png: test top-1 per task (in-domain and out-of-domain) beside chance."""
    plt = pyplot()
    tasks = list(result["tasks"])
    figure, axis = plt.subplots(figsize=(1.8 + 1.6 * len(tasks), 3.6))
    positions = torch.arange(len(tasks)).float()
    in_domain = [result["tasks"][t]["test_top1"] for t in tasks]
    out_domain = [result["tasks"][t].get("test_ood_top1", float("nan")) for t in tasks]
    axis.bar(positions - 0.2, in_domain, 0.4, label="test, in-domain")
    axis.bar(positions + 0.2, out_domain, 0.4, label="test, out-of-domain")
    axis.scatter(positions, [100 / result["tasks"][t]["classes"] for t in tasks], marker="_", s=400, color="black",
                 label="chance", zorder=3)
    axis.set_xticks(positions.tolist(), tasks)
    axis.set_ylabel("linear probe top-1 (%)")
    axis.set_ylim(0, 100)
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    return save_figure(figure, out_dir, "probe")


def analyze_probe(loaded: Pretrained, out_dir, tasks: Sequence[str] = TASKS, train_size: int = 2000,
                  validation_size: int = 500, test_size: int = 1000, batch_size: int = 256) -> dict:
    """Probe each task, write probe.png and probe.json; returns the JSON dict."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ConfigError(f"unknown probe task(s) {unknown}; choose from {list(TASKS)}")
    if min(train_size, validation_size, test_size) < 1:
        raise ConfigError("--train-size, --validation-size and --test-size must be ≥ 1")
    result = {"analysis": "probe", "model": loaded.name, "checkpoint": str(loaded.checkpoint),
              "features": "image class tokens after ln_post, before the projection, concatenated",
              "classifier": "logistic regression, L-BFGS, weight decay chosen on the val split",
              "tasks": {}}
    sets = task_sets(loaded, train_size, validation_size, test_size)
    for task in tasks:
        result["tasks"][task] = probe_task(loaded, task, sets, batch_size)
    result["plots"] = [plot_probe(result, out_dir).name]
    write_json(out_dir, "probe", result)
    return result
