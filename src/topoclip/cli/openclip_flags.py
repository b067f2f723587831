"""OpenCLIP's training flags on `topoclip train`: each one that has a topoclip setting is an alias for it (turned
into `--set` overrides before the user's own, which win); each one that has none is answered in one line naming
what to do instead. One table, `FLAGS`; the README's "Coming from OpenCLIP" table lists the same.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

from topoclip.config import ConfigError
from topoclip.core.distributed import launch_world_size


@dataclass(frozen=True)
class Flag:
    """One OpenCLIP flag: how argparse reads it, and the topoclip settings it stands for (or why none does)."""

    name: str
    kind: Any = str  # argparse type; None for a switch (store_true)
    # value -> ["key=value", ...] topoclip overrides; None when the flag has no topoclip equivalent
    settings: Optional[Callable[[Any], list[str]]] = None
    instead: str = ""  # for a flag without an equivalent: what to do instead


def _set(key: str, convert: Callable[[Any], Any] = lambda value: value) -> Callable[[Any], list[str]]:
    return lambda value: [f"{key}={json.dumps(convert(value))}"]


def _precision(value: str) -> list[str]:
    """OpenCLIP's --precision -> train.precision (topoclip keeps fp32 weights under autocast: no pure_*)."""
    settings = {"amp": "fp16", "amp_fp16": "fp16", "amp_bf16": "bf16", "amp_bfloat16": "bf16", "fp32": "fp32"}
    if value not in settings:  # OpenCLIP's fp16, bf16 and pure_* cast the weights themselves
        raise ConfigError(f"--precision {value}: topoclip keeps fp32 master weights under autocast, so OpenCLIP's "
                          f"half-precision weights (fp16, bf16, pure_*) have no equivalent; use amp_bf16 "
                          f"(train.precision=bf16) or amp (fp16)")
    return [f"train.precision={settings[value]}"]


def _report_to(value: str) -> list[str]:
    names = ["tensorboard", "wandb"] if value == "all" else [name.strip() for name in value.split(",") if name.strip()]
    return [f"train.report_to={json.dumps(names)}"]


def _switch(*keys: str) -> Callable[[Any], list[str]]:
    return lambda value: [f"{key}=true" for key in keys] if value else []


FLAGS = [
    Flag("--lr", float, _set("train.lr")),
    Flag("--wd", float, _set("train.weight_decay")),
    Flag("--warmup", int, _set("train.warmup_steps")),
    Flag("--eps", float, _set("train.eps")),
    Flag("--grad-clip-norm", float, _set("train.grad_clip")),
    Flag("--seed", int, _set("train.seed")),
    Flag("--workers", int, _set("train.num_workers")),
    Flag("--precision", str, _precision),
    Flag("--report-to", str, _report_to),
    Flag("--lock-image", None, _switch("train.lock_image")),
    Flag("--lock-image-unlocked-groups", int, _set("train.lock_image_unlocked_groups")),
    Flag("--lock-text", None, _switch("train.lock_text")),
    Flag("--lock-text-unlocked-layers", int, _set("train.lock_text_unlocked_layers")),
    Flag("--grad-checkpointing", None, _switch("train.gradient_checkpointing")),
    Flag("--torchcompile", None, _switch("train.compile")),
    Flag("--force-quick-gelu", None, _switch()),  # handled below: both towers' activation
    Flag("--train-data", str, _set("data.train_data")),
    Flag("--train-num-samples", int, _set("data.samples_per_epoch")),
    Flag("--dataset-resampled", None, _switch("data.resampled")),
    Flag("--csv-img-key", str, _set("data.csv_image_key")),
    Flag("--csv-caption-key", str, _set("data.csv_caption_key")),
    Flag("--csv-separator", str, _set("data.csv_separator")),
    Flag("--name", str, _set("name")),
    # Resolved together in `overrides` (they depend on one another and on the world size).
    Flag("--batch-size", int), Flag("--accum-freq", int), Flag("--epochs", int), Flag("--dataset-type", str),
    # No topoclip equivalent: answered in one line.
    # --pretrained NAME (or OpenCLIP's --model MODEL --pretrained TAG): `pretrained_name`, a run from those weights.
    Flag("--model", str), Flag("--pretrained", str),
    Flag("--logs", instead="give the run folder itself: --out DIR (default runs/NAME-TIMESTAMP)"),
    Flag("--save-frequency", instead="checkpoints are taken in steps: --set train.checkpoint_every=N"),
    Flag("--val-frequency", instead="evaluations are taken in steps: --set train.eval_every=N"),
    Flag("--zeroshot-frequency", instead="evaluations are taken in steps: --set train.eval_every=N"),
    Flag("--local-loss", None, instead="topoclip always computes the exact loss of the global batch (each rank's "
                                       "rows against every rank's): drop the flag"),
    Flag("--gather-with-grad", None, instead="topoclip always gathers features with their gradients: drop the flag"),
]


def add_openclip_flags(parser: argparse.ArgumentParser) -> None:
    """OpenCLIP's flags, in their own group of `topoclip train --help`."""
    group = parser.add_argument_group("OpenCLIP's flags", "accepted as aliases for the topoclip settings they stand "
                                      "for (the README's 'Coming from OpenCLIP' table); --set wins over them")
    for flag in FLAGS:
        dest = "openclip_" + flag.name.lstrip("-").replace("-", "_")
        if flag.kind is None:
            group.add_argument(flag.name, dest=dest, action="store_true", default=False, help=argparse.SUPPRESS)
        else:
            group.add_argument(flag.name, dest=dest, type=flag.kind, default=None, help=argparse.SUPPRESS)


def pretrained_name(args: argparse.Namespace) -> Optional[str]:
    """The pretrained model (topoclip.io.pretrained) that --pretrained names: MODEL:TAG, or OpenCLIP's --model MODEL
    --pretrained TAG; None without --pretrained. ConfigError for --model alone."""
    model, tag = args.openclip_model, args.openclip_pretrained
    if tag is None:
        if model is not None:
            raise ConfigError("--model is OpenCLIP's; topoclip's models are presets: --preset NAME (`topoclip presets`; "
                              "e.g. sphere-vit-b16 for OpenCLIP's ViT-B-16), or a pretrained one: --pretrained "
                              "MODEL:TAG (`topoclip pretrained`)")
        return None
    return f"{model}:{tag}" if model is not None and ":" not in tag else tag


def overrides(args: argparse.Namespace, epoch_steps: Callable[[list[str]], Optional[int]]) -> list[str]:
    """The `--set` overrides the OpenCLIP flags of `args` stand for; ConfigError in one line for one without.

    epoch_steps(overrides) -> optimiser steps per epoch of the run those overrides (before the user's --set) give:
    its data and its batch, from the config it will train with, or None when its data has no fixed epoch.
    """
    given = {flag.name: getattr(args, "openclip_" + flag.name.lstrip("-").replace("-", "_")) for flag in FLAGS}
    given = {name: value for name, value in given.items() if value is not None and value is not False}  # 0 counts
    found = []
    for flag in FLAGS:
        if flag.name not in given or flag.name in ("--model", "--pretrained"):
            continue
        if flag.instead:
            raise ConfigError(f"{flag.name} is OpenCLIP's; {flag.instead}")
        if flag.settings is not None:
            found += flag.settings(given[flag.name])
    if "--force-quick-gelu" in given:
        found += ["model.vision.activation=quick_gelu", "model.text.activation=quick_gelu"]
    kind = given.get("--dataset-type")
    if kind is not None or "--train-data" in given:
        sources = {"webdataset": "shards", "csv": "csv"}
        if kind not in (None, "auto", *sources):
            raise ConfigError(f"--dataset-type {kind}: topoclip reads webdataset shards and CSV/TSV files (and its "
                              f"built-in scenes without --train-data)")
        data = given.get("--train-data", "")
        source = sources.get(kind) or ("csv" if data.lower().endswith((".csv", ".tsv", ".tab")) else "shards")
        found.append(f"data.source={source}")
    # OpenCLIP's --batch-size is per GPU and --accum-freq multiplies it; topoclip's train.batch_size is the global
    # batch of one optimiser step, split into train.accumulation_steps micro-batches.
    accumulation = given.get("--accum-freq", 1)
    if "--batch-size" in given or "--accum-freq" in given:
        if "--batch-size" not in given:
            raise ConfigError("--accum-freq multiplies OpenCLIP's per-GPU --batch-size: give --batch-size too")
        world = launch_world_size()  # torchrun's WORLD_SIZE, or srun's SLURM_NTASKS
        found += [f"train.batch_size={given['--batch-size'] * world * accumulation}",
                  f"train.accumulation_steps={accumulation}"]
    if "--epochs" in given:
        steps = epoch_steps(found)
        if steps is None:
            raise ConfigError("--epochs: these shards have no fixed epoch; give --train-num-samples (OpenCLIP's), or "
                              "the steps: --set train.steps=N")
        found.append(f"train.steps={given['--epochs'] * steps}")
    return found
