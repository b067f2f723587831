"""OpenCLIP's training flags on `topoclip train`, every one of them (open_clip_train.params; a field-lane test holds
the list to the released parser): each that has a topoclip setting is an alias for it (turned into `--set` overrides
before the user's own, which win); each whose effect topoclip always has is accepted and changes nothing; each other
is answered in one line naming what to do instead. One table, `FLAGS`; the README's "Coming from OpenCLIP" table
lists the same.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from topoclip.config import ConfigError
from topoclip.core.distributed import launch_rank, launch_world_size
from topoclip.data.hf import is_hf_data


@dataclass(frozen=True)
class Flag:
    """One OpenCLIP flag: how argparse reads it, and the topoclip settings it stands for (or why none does)."""

    name: str
    kind: Any = str  # argparse type; None for a switch (store_true)
    # value -> ["key=value", ...] topoclip overrides; None when the flag has no topoclip equivalent
    settings: Optional[Callable[[Any], list[str]]] = None
    instead: str = ""  # for a flag without an equivalent: what to do instead
    means: str = ""  # its line in `topoclip train --help` (default: the setting it sets, or `instead`)
    nargs: Optional[str] = None  # argparse's, for the flags that take several values (OpenCLIP's "+")
    accepted: bool = False  # topoclip always does what it asks: taken, nothing set

    @property
    def help(self) -> str:
        if self.means:
            return self.means
        if self.instead:
            return f"no equivalent: {self.instead}"
        return f"= --set {self.settings.setting}"


def _set(key: str, convert: Callable[[Any], Any] = lambda value: value) -> Callable[[Any], list[str]]:
    def settings(value: Any) -> list[str]:
        return [f"{key}={json.dumps(convert(value))}"]

    settings.setting = f"{key}=…"
    return settings


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
    def settings(value: bool) -> list[str]:
        return [f"{key}=true" for key in keys] if value else []

    settings.setting = " ".join(f"{key}=true" for key in keys)
    return settings


def _image_size(values: list[int]) -> list[str]:
    """OpenCLIP's --force-image-size: one size, or height and width."""
    if len(values) > 2 or len(set(values)) != 1:
        raise ConfigError(f"--force-image-size {' '.join(map(str, values))}: topoclip's images are square; give one "
                          f"size (model.vision.image_size)")
    return [f"model.vision.image_size={values[0]}"]


def _siglip(value: bool) -> list[str]:
    """OpenCLIP's --siglip: the sigmoid loss, and its model's start (logit scale log 10, logit bias −10)."""
    return ["train.loss=sigmoid", f"model.temperature.init={math.log(10)!r}", "model.temperature.bias_init=-10.0"]


NO_SETTING = "topoclip has no setting for it; drop it (the README's 'Coming from OpenCLIP' lists the flags that map)"


FLAGS = [
    Flag("--lr", float, _set("train.lr")),
    Flag("--wd", float, _set("train.weight_decay")),
    Flag("--warmup", int, _set("train.warmup_steps")),
    Flag("--eps", float, _set("train.eps")),
    Flag("--grad-clip-norm", float, _set("train.grad_clip")),
    Flag("--seed", int, _set("train.seed")),
    Flag("--workers", int, _set("train.num_workers")),
    Flag("--log-every-n-steps", int, _set("train.log_every")),
    Flag("--device", str, _set("train.device")),
    Flag("--delete-previous-checkpoint", None, lambda value: ["train.keep_checkpoints=1"] if value else [],
         means="= --set train.keep_checkpoints=1"),
    Flag("--image-mean", float, _set("model.vision.mean"), nargs="+"),
    Flag("--image-std", float, _set("model.vision.std"), nargs="+"),
    Flag("--force-image-size", int, _image_size, nargs="+", means="= --set model.vision.image_size=… (square)"),
    Flag("--force-context-length", int, _set("model.text.context_length")),
    Flag("--siglip", None, lambda value: _siglip(value) if value else [],
         means="= --set train.loss=sigmoid model.temperature.init=ln 10 model.temperature.bias_init=-10"),
    Flag("--precision", str, _precision, means="amp_bf16 / amp / fp32: = --set train.precision=bf16 / fp16 / fp32"),
    Flag("--report-to", str, _report_to, means="wandb, tensorboard or all: = --set train.report_to=[…]"),
    Flag("--lock-image", None, _switch("train.lock_image")),
    Flag("--lock-image-unlocked-groups", int, _set("train.lock_image_unlocked_groups")),
    Flag("--lock-text", None, _switch("train.lock_text")),
    Flag("--lock-text-unlocked-layers", int, _set("train.lock_text_unlocked_layers")),
    Flag("--grad-checkpointing", None, _switch("train.gradient_checkpointing")),
    Flag("--torchcompile", None, _switch("train.compile")),
    Flag("--force-quick-gelu", None, _switch(), means="= --set model.vision.activation=quick_gelu "
                                                      "model.text.activation=quick_gelu"),  # handled below
    Flag("--train-data", str, _set("data.train_data")),
    Flag("--train-num-samples", int, _set("data.samples_per_epoch")),
    Flag("--dataset-resampled", None, _switch("data.resampled")),
    Flag("--csv-img-key", str, _set("data.csv_image_key")),
    Flag("--csv-caption-key", str, _set("data.csv_caption_key")),
    # OpenCLIP hands its --csv-separator to pandas, which reads '\t' (backslash, t) as a tab: so here too
    Flag("--csv-separator", str, _set("data.csv_separator", lambda value: "\t" if value == "\\t" else value)),
    Flag("--name", str, _set("name")),
    # Resolved together in `overrides` (they depend on one another and on the world size).
    Flag("--batch-size", int, means="per GPU, as OpenCLIP's: train.batch_size = it × GPUs × --accum-freq"),
    Flag("--accum-freq", int, means="= --set train.accumulation_steps=K (and multiplies --batch-size)"),
    Flag("--epochs", int, means="train.steps = it × the steps of one epoch of the run's data and batch"),
    Flag("--dataset-type", str, means="webdataset or csv: data.source (auto: from --train-data)"),
    Flag("--beta1", float, means="with --beta2: = --set train.betas=[beta1,beta2]"),
    Flag("--beta2", float, means="with --beta1: = --set train.betas=[beta1,beta2]"),
    # No topoclip equivalent: answered in one line.
    # --pretrained NAME (or OpenCLIP's --model MODEL --pretrained TAG): `pretrained_name`, a run from those weights;
    # --pretrained PATH, a model on disk: `local_pretrained`, as --init-from PATH.
    Flag("--model", str, means="with --pretrained TAG: the pretrained model MODEL:TAG (`topoclip pretrained`)"),
    Flag("--pretrained", str, means="MODEL:TAG, or TAG with --model: a run from those weights; or a model on disk "
         "(a topoclip run or checkpoint folder, a transformers model folder): = --init-from PATH"),
    Flag("--logs", str, means="the run folder is LOGS/NAME with --name (as OpenCLIP's), else LOGS/NAME-TIMESTAMP; "
                              "or give it: --out DIR"),
    Flag("--save-frequency", int, means="in epochs: = --set train.checkpoint_every=it × the steps of an epoch"),
    Flag("--val-frequency", int, means="in epochs: = --set train.eval_every=it × the steps of an epoch"),
    Flag("--zeroshot-frequency", int, means="in epochs: = --set train.eval_every=it × the steps of an epoch"),
    # What they ask for, topoclip always does: accepted, nothing set (OpenCLIP's multi-GPU lines carry them).
    Flag("--local-loss", None, accepted=True, means="accepted: each rank's rows against the gathered global batch, "
                                                    "always"),
    Flag("--gather-with-grad", None, accepted=True, means="accepted: the gather carries gradients, always"),
    Flag("--ddp-static-graph", None, accepted=True, means="accepted: DDP's graph as topoclip sets it"),
    Flag("--no-set-device-rank", None, accepted=True, means="accepted: each process takes its LOCAL_RANK's device"),
    Flag("--dist-url", str, accepted=True, means="accepted: torchrun's env:// rendezvous, always"),
    Flag("--dist-backend", str, accepted=True, means="accepted: NCCL on CUDA, gloo elsewhere"),
    Flag("--save-most-recent", None, accepted=True, means="accepted: the newest checkpoints are kept, always "
                                                          "(train.keep_checkpoints)"),
    # The rest of OpenCLIP's flags: no topoclip setting, answered in one line.
    Flag("--val-data", str, settings=lambda value: [f"evaluate.retrieval={json.dumps([caption_table(value)])}"],
         means="a caption table (.csv/.tsv, the --csv-* columns) scored as retrieval during and after training: "
               "= --set evaluate.retrieval=[it]"),
    Flag("--val-num-samples", instead="topoclip scores the whole --val-data table"),
    Flag("--imagenet-v2", instead="zero-shot on ImageNet-V2 after training: topoclip benchmark RUN -- --dataset "
                                  "imagenetv2"),
    Flag("--image-interpolation", instead="topoclip resizes bicubic, as OpenCLIP's default"),
    Flag("--image-resize-mode", instead="evaluation's resizing is model.vision.eval_resize (shortest: OpenCLIP's "
                                        "default)"),
    Flag("--aug-cfg", nargs="*", instead="topoclip's training augmentation is its random resized crop, fixed"),
    Flag("--lr-scheduler", instead="topoclip's schedule is linear warm-up then cosine decay (train.warmup_steps)"),
    Flag("--opt", instead="topoclip trains with AdamW (train.lr, train.betas, train.eps, train.weight_decay)"),
    Flag("--momentum", instead="topoclip trains with AdamW: no momentum setting"),
    Flag("--wandb-project-name", instead="set WANDB_PROJECT=NAME; --report-to wandb logs there"),
    Flag("--wandb-notes", instead="set WANDB_NOTES=TEXT; --report-to wandb logs there"),
    *(Flag(name, instead=NO_SETTING) for name in (
        "--train-data-upsampling-factors", "--cache-dir", "--log-local", "--epochs-cooldown", "--use-bn-sync",
        "--skip-scheduler", "--lr-cooldown-end", "--lr-cooldown-power", "--pretrained-image",
        "--lock-image-freeze-bn-stats", "--force-patch-dropout", "--force-custom-text", "--torchscript", "--trace",
        "--copy-codebase", "--horovod", "--lock-text-freeze-layer-norm", "--coca-caption-loss-weight",
        "--coca-contrastive-loss-weight", "--remote-sync", "--remote-sync-frequency", "--remote-sync-protocol",
        "--distill-model", "--distill-pretrained", "--use-bnb-linear", "--loss-dist-impl")),
]
# OpenCLIP's flags that are topoclip's own too, the same in spirit: --resume (a run folder here; OpenCLIP's
# `--resume latest` with --logs and --name continues LOGS/NAME), --imagenet-val, --debug.
OWN = ("--resume", "--imagenet-val", "--debug")


def add_openclip_flags(parser: argparse.ArgumentParser) -> None:
    """OpenCLIP's flags, in their own group of `topoclip train --help`."""
    group = parser.add_argument_group("OpenCLIP's flags", "every flag of open_clip_train: an alias for the topoclip "
                                      "settings it stands for (--set wins over it), accepted where topoclip always "
                                      "does what it asks, or answered in one line")
    for flag in FLAGS:
        dest = "openclip_" + flag.name.lstrip("-").replace("-", "_")
        metavar = flag.name.lstrip("-").upper().replace("-", "_")
        if flag.kind is None:
            group.add_argument(flag.name, dest=dest, action="store_true", default=False, help=flag.help)
        elif flag.instead:  # answered in one line whatever follows it: its values, if any, are taken with it
            group.add_argument(flag.name, dest=dest, nargs=flag.nargs or "?", default=None, metavar="…", help=flag.help,
                               **({} if flag.nargs else {"const": True}))
        else:
            group.add_argument(flag.name, dest=dest, type=flag.kind, default=None, metavar=metavar, help=flag.help,
                               nargs=flag.nargs)


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
    if model is not None and ":" in tag and tag.partition(":")[0] != model:
        raise ConfigError(f"--model {model:.60} and --pretrained {tag:.80} name two models; give --pretrained MODEL:TAG "
                          f"alone, or --model MODEL --pretrained TAG")
    return joined_name(model, tag)


def joined_name(model: Optional[str], tag: str) -> str:
    """OpenCLIP's --model MODEL --pretrained TAG as topoclip's MODEL:TAG (a TAG holding ":" is a whole name)."""
    return f"{model}:{tag}" if model is not None and ":" not in tag else tag


def caption_table(path: str) -> str:
    """--val-data's value when it is a caption table (topoclip.data.folders.CAPTION_TABLE_SUFFIXES); ConfigError in
    one line for OpenCLIP's other kinds (WebDataset shards)."""
    from topoclip.data.folders import CAPTION_TABLE_SUFFIXES

    if Path(path).suffix.lower() not in CAPTION_TABLE_SUFFIXES:
        raise ConfigError(f"--val-data {path:.200}: topoclip scores a caption table (.csv or .tsv) as retrieval during "
                          f"training; WebDataset shards are scored after it: topoclip benchmark RUN (CLIP_benchmark's "
                          f"wds sets), or --set evaluate.retrieval='[\"a CLIP_benchmark wds folder\"]'")
    return path


def local_pretrained_given(args: argparse.Namespace) -> bool:
    """Whether --pretrained names a model on disk: a path that exists and is not a pretrained name (a name wins, as
    in OpenCLIP, over a file or folder that happens to share it)."""
    from topoclip.io.pretrained import PRETRAINED

    path = args.openclip_pretrained
    if path is None or not os.path.lexists(path):
        return False
    return joined_name(args.openclip_model, path) not in PRETRAINED


def local_pretrained(args: argparse.Namespace) -> str:
    """OpenCLIP's `--pretrained PATH` (a model on disk, beside --model or not) as --init-from PATH, when topoclip reads
    PATH as it is (a topoclip run or checkpoint folder or its weights file, a transformers CLIPModel or SiglipModel
    folder); ConfigError in one line naming the conversion otherwise (OpenCLIP's own checkpoint files)."""
    from topoclip.io.checkpoint import resolve_checkpoint

    path = args.openclip_pretrained
    if args.init_from or args.resume:
        raise ConfigError("--pretrained starts a new run from a pretrained model; it cannot be combined with "
                          "--init-from or --resume")
    if not os.path.exists(path) or not (os.path.isdir(path) or os.path.isfile(path)):
        raise ConfigError(f"--pretrained {path:.200}: not a file or folder (a link to nothing, a FIFO, a device); give "
                          f"a topoclip run or checkpoint folder, or a pretrained name (`topoclip pretrained`)")
    try:
        resolve_checkpoint(Path(path))
    except FileNotFoundError:
        raise ConfigError(f"--pretrained {path:.200}: a model on disk is a topoclip run or checkpoint folder or a "
                          f"transformers model folder; convert OpenCLIP's own files first (topoclip convert --from "
                          f"openclip {path:.200} OUT), then --pretrained OUT") from None
    if args.openclip_model is not None and launch_rank() == 0:
        print(f"topoclip: note: --model {args.openclip_model:.60} is not read: the run takes {path:.200}'s own model "
              f"(its config)", file=sys.stderr)
    return path


def overrides(args: argparse.Namespace, epoch_steps: Callable[[list[str]], Optional[int]]) -> list[str]:
    """The `--set` overrides the OpenCLIP flags of `args` stand for; ConfigError in one line for one without.

    epoch_steps(overrides) -> optimiser steps per epoch of the run those overrides (before the user's --set) give:
    its data and its batch, from the config it will train with, or None when its data has no fixed epoch.
    """
    given = {flag.name: getattr(args, "openclip_" + flag.name.lstrip("-").replace("-", "_")) for flag in FLAGS}
    given = {name: value for name, value in given.items() if value is not None and value is not False}  # 0 counts
    found = []
    for flag in FLAGS:
        if flag.name not in given or flag.name in ("--model", "--pretrained") or flag.accepted:
            continue
        if flag.instead:
            raise ConfigError(f"{flag.name} is OpenCLIP's; {flag.instead}")
        if flag.settings is not None:
            found += flag.settings(given[flag.name])
    if "--beta1" in given or "--beta2" in given:
        if not ("--beta1" in given and "--beta2" in given):
            raise ConfigError("--beta1 and --beta2 are one setting here, train.betas: give both")
        found.append(f"train.betas={json.dumps([given['--beta1'], given['--beta2']])}")
    if "--force-quick-gelu" in given:
        found += ["model.vision.activation=quick_gelu", "model.text.activation=quick_gelu"]
    kind = given.get("--dataset-type")
    if kind is not None or "--train-data" in given:
        sources = {"webdataset": "shards", "csv": "csv"}
        if kind not in (None, "auto", *sources):
            raise ConfigError(f"--dataset-type {kind}: topoclip reads webdataset shards and CSV/TSV files (and its "
                              f"built-in scenes without --train-data; a Hugging Face datasets folder or Parquet/Arrow "
                              f"files with --train-data alone)")
        data = given.get("--train-data", "")
        source = sources.get(kind) or ("csv" if data.lower().endswith((".csv", ".tsv", ".tab")) else
                                       "hf" if kind in (None, "auto") and is_hf_data(data) else "shards")
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
    # Counted in epochs by OpenCLIP, in steps here: each times the steps of one epoch of this run's data and batch.
    in_epochs = {"--epochs": "train.steps", "--save-frequency": "train.checkpoint_every",
                 "--val-frequency": "train.eval_every", "--zeroshot-frequency": "train.eval_every"}
    for name in set(in_epochs) & set(given):
        if given[name] < 1:
            raise ConfigError(f"{name} {given[name]}: a number of epochs, at least 1")
    cadences = {given[name] for name in ("--val-frequency", "--zeroshot-frequency") if name in given}
    if len(cadences) > 1:  # one evaluation here: the validation and zero-shot sets are evaluated together
        raise ConfigError("--val-frequency and --zeroshot-frequency differ; topoclip evaluates both kinds at once "
                          "(train.eval_every): give one")
    if set(in_epochs) & set(given):
        steps = epoch_steps(found)
        for name, key in in_epochs.items():
            if name not in given:
                continue
            if steps is None:
                raise ConfigError(f"{name} counts epochs, and these shards have no fixed epoch; give "
                                  f"--train-num-samples (OpenCLIP's), or the steps: --set {key}=N")
            found.append(f"{key}={given[name] * steps}")
    return found
