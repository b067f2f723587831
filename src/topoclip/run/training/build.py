"""A run's parts as `train` starts it (topoclip.run.training.trainer): the tokenizer, the model and its TrainState,
restored from the newest good checkpoint when resuming, wrapped for DDP and compiled as the config says (`build`);
the loop (trainer.train_steps) and `finish` take the `Run` it returns."""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from topoclip.config import Config, to_dict
from topoclip.core.atomic import write_text_atomic
from topoclip.core.distributed import DistributedInfo, gather_objects
from topoclip.core.door import read_text
from topoclip.core.workers import loader_workers
from topoclip.core.errors import CheckpointError, RunFolderError
from topoclip.data.sources import get_source
from topoclip.data.streams import StreamPosition
from topoclip.io.checkpoint import load_weights, save_checkpoint
from topoclip.io.run_folder import RunFolder
from topoclip.model.clip import CLIP
from topoclip.preprocess.tokenizer import Tokenizer
from topoclip.run.training.lock import apply_locks
from topoclip.run.training.optim import build_optimizer, build_scheduler
from topoclip.run.training.resume import require_fitting_checkpoint
from topoclip.run.training.sharding import shard
from topoclip.run.training.state import TrainState
from topoclip.run.training.tokenizer_setup import build_tokenizer, check_tokenizer, fit_to_trained_tokenizer


@dataclass
class Run:
    """One rank's run as `build` makes it: what the loop and `finish` use."""

    config: Config
    folder: RunFolder
    info: DistributedInfo
    tokenizer: Tokenizer
    state: TrainState
    trained: torch.nn.Module  # the model as the step calls it: wrapped for DDP, compiled
    position: StreamPosition  # this rank's place in a user data stream
    user_stream: bool  # a user stream keeps a position; the scenes are a function of the step
    resumed_stream: Optional[dict] = None  # this rank's stream position in the checkpoint resumed from

    main = property(lambda self: self.info.rank == 0)
    device = property(lambda self: self.info.device)  # train.device, resolved for this rank by init_distributed


def build(config: Config, folder: RunFolder, resuming: bool, info: DistributedInfo) -> Run:
    """The tokenizer, the model, its optimiser and schedule, restored from the newest good checkpoint when resuming;
    a fresh run's config.json and tokenizer.json written."""
    settings, main, device = config.train, info.rank == 0, info.device
    if main:
        print(f"run folder: {folder.path.resolve()}", flush=True)
    torch.manual_seed(settings.seed)
    # A fresh run's folder is empty; a resumed run keeps its tokenizer. Every rank builds the same one
    # (training one is deterministic) and none reads a file rank 0 writes.
    tokenizer = build_tokenizer(config, folder.tokenizer if resuming and os.path.lexists(folder.tokenizer) else None)
    if not resuming:  # a resumed run keeps the ids its config.json recorded
        config = fit_to_trained_tokenizer(config, tokenizer)
    check_tokenizer(tokenizer, config)
    if main and not resuming:
        write_text_atomic(folder.config, json.dumps(to_dict(config), indent=2))
        tokenizer.save(folder.tokenizer)
    found = folder.step_checkpoints() if resuming else []  # this process holds the folder: the list stays true
    if found:  # the folder's config: its shapes checked before allocating
        require_fitting_checkpoint(found, config.model)
    state = build_state(config, device, initialise=not found, lora_base=folder.lora_base if main or found else None)
    position, resumed_stream = StreamPosition(loader_workers(settings.num_workers), info.world_size), None
    if resuming:
        position, resumed_stream = restore(state, config, folder, found, info)
    if main and not resuming and settings.warmup_steps >= settings.steps > 1:  # a short run on small data, say
        print(f"topoclip: note: train.warmup_steps = {settings.warmup_steps} is not below train.steps = "
              f"{settings.steps}: the lr rises to {100 * settings.steps / settings.warmup_steps:.2g} % of train.lr "
              f"and never decays; set fewer (OpenCLIP's --warmup), e.g. --set "
              f"train.warmup_steps={max(1, settings.steps // 10)}", file=sys.stderr)
    if main and state.adapters is not None:
        from topoclip.model.lora import trainable_count

        trained, total = trainable_count(state.model)
        print(f"LoRA rank {settings.lora_rank} on {' and '.join(settings.lora_towers)}: {trained:,} of {total:,} "
              f"weights train ({100 * trained / total:.2f} %)", flush=True)
    trained = state.model
    if info.world_size > 1 and settings.parallelism == "ddp":
        trained = torch.nn.parallel.DistributedDataParallel(
            state.model, device_ids=[device.index] if device.type == "cuda" else None)
    if settings.compile:
        trained = torch.compile(trained)
    return Run(config, folder, info, tokenizer, state, trained, position,
               user_stream=get_source(config.data.source).stream, resumed_stream=resumed_stream)


def build_state(config: Config, device: torch.device, initialise: bool, lora_base: Optional[Path] = None) -> TrainState:
    """The model (from train.init_from when `initialise`), locked as train.lock_* say, with its optimiser, lr
    schedule and (fp16) loss scaler, at step 0. With LoRA (train.lora_rank), its adapters are added and the frozen
    base weights are written to `lora_base` when `initialise` (on the main process), read from it otherwise."""
    settings = config.train
    model = CLIP(config.model).to(device)
    if settings.init_from and initialise:
        from topoclip.run.training.init_from import load_initial_weights

        load_initial_weights(model, config)
    adapters = None
    if settings.lora_rank:
        from topoclip.model.lora import add_adapters

        if initialise and lora_base is not None:
            save_checkpoint(lora_base, model, config)
        elif not initialise:
            if lora_base is None or not lora_base.is_dir():
                raise CheckpointError(f"{lora_base}: missing; a LoRA run keeps its frozen base weights there, which "
                                      f"its checkpoints' adapters need to resume")
            load_weights(model, lora_base)
        adapters = add_adapters(model, settings)
    if settings.gradient_checkpointing:
        model.set_gradient_checkpointing(True)
    apply_locks(model, settings)  # before the optimiser: locked weights are left out of it
    if settings.parallelism == "fsdp":  # before the optimiser too: it holds the shards
        shard(model)
    optimizer = build_optimizer(model, settings)
    scaler = torch.amp.GradScaler(device.type) if settings.precision == "fp16" else None
    return TrainState(model, optimizer, build_scheduler(optimizer, settings), scaler, adapters=adapters)


def restore(state: TrainState, config: Config, folder: RunFolder, found: list[Path],
            info: DistributedInfo) -> tuple[StreamPosition, Optional[dict]]:
    """A resumed run: `state` from the newest good checkpoint of `found` (if any), then config.json takes the
    resume's changes; returns this rank's stream position, and as the checkpoint saved it (None: the scenes)."""
    main, streams = info.rank == 0, None
    if found:
        used = state.restore(found, main)
        chosen = sorted(set(gather_objects(used.name)))
        if len(chosen) > 1:  # a file one rank could read and another not: the shards would be of different steps
            raise CheckpointError(f"the ranks resumed from different checkpoints ({', '.join(chosen)}) of "
                                  f"{folder.checkpoints}: a file there reads on some ranks only; check the "
                                  f"filesystem every rank sees and resume again")
        streams = state.streams[min(info.rank, len(state.streams) - 1)] if state.streams else None  # this rank's
    # (a stream split another way cannot continue: refused before config.json takes the resume's changes)
    position = StreamPosition(loader_workers(config.train.num_workers), info.world_size, streams)
    if main:
        print(f"resuming from {used.name}" if found else "no checkpoint yet: starting from step 0", flush=True)
        # Only now that the checkpoint has loaded does the saved config take the resume's changes.
        text = json.dumps(to_dict(config), indent=2)
        if read_text(folder.config, "the run's config", folder.path, error=RunFolderError) != text:
            write_text_atomic(folder.config, text)
    return position, streams
