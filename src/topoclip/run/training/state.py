"""A run's training state as one object (`TrainState`): the model, its optimiser, lr schedule and loss scaler, the
data counts, the step and this rank's stream position. A step checkpoint saves it (weights as safetensors, the
rest in training_state.pt) and a resume restores it from the newest checkpoint that loads, checked before use.
Rank 0 writes, except a sharded run's optimiser state, which every rank writes its shards of (training.sharding);
every rank restores from the same checkpoint."""
from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from topoclip.core.atomic import scratch_name
from topoclip.io.checkpoint import (OPTIMIZER_SHARDS, STEP_NAME, STEP_PREFIX, TRAINING_STATE, checkpoint_step, load_training_state,
                                 load_weights, prune_checkpoints, read_weights, save_checkpoint, step_checkpoints)
from topoclip.data.quality import BadSampleCounter
from topoclip.data.streams import StreamPosition
from topoclip.core.distributed import broadcast_object, is_sharded
from topoclip.core.errors import CheckpointError, DiskFullError
from topoclip.run.training.guard import parameters_finite
from topoclip.run.training.sharding import (full_weights, load_full_optimizer, load_full_weights, load_optimizer_shards,
                                        save_optimizer_shards)


def rng_states() -> dict:
    """This process's torch RNG states (CPU and every CUDA device), as a checkpoint stores them."""
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


@dataclass
class TrainState:
    """Everything a step checkpoint saves and a resume restores.

    step: the steps trained; streams: after `restore`, every rank's data-stream position as the checkpoint saved
    them (user data), or None (the built-in scenes are a function of the step; an older topoclip saved none);
    skipped: the steps skipped for a non-finite loss so far (a resumed run counts on from it; an older topoclip
    saved none, read as 0).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: Optional[torch.amp.GradScaler]
    counter: BadSampleCounter = field(default_factory=BadSampleCounter)
    step: int = 0
    streams: Optional[list] = None
    skipped: int = 0
    adapters: Any = None  # a LoRA run's peft model around `model` (topoclip.model.lora), which saves the adapters

    def snapshot(self, step: int, streams: Optional[list], skipped: int = 0) -> dict:
        """What a checkpoint of `step` saves besides the live objects, as of now: the data counts (copied), the RNG
        states, every rank's stream position (None for the scenes) and the steps skipped so far."""
        return {"step": step, "counter": BadSampleCounter(self.counter.kept, self.counter.bad), "rng": rng_states(),
                "streams": streams, "skipped": skipped}

    def gathered(self, folder: Path, step: int, main: bool) -> tuple[dict, dict, Optional[Path]]:
        """(weights, optimiser state, its shards' folder or None) of a checkpoint of `step` under `folder`, made on
        every rank. An unsharded run's are its state_dict()s. A sharded run's weights are gathered to rank 0 and
        every rank writes its shards of the optimiser state into a new scratch folder (collectives: every rank calls
        this); the optimiser state is then the parameter groups and where the shards are."""
        if self.adapters is not None:  # the merged model: what every reader of model.safetensors loads
            from topoclip.model.lora import merged_weights

            return merged_weights(self.model), self.optimizer.state_dict(), None
        if not is_sharded(self.model):
            return self.model.state_dict(), self.optimizer.state_dict(), None
        weights = full_weights(self.model)
        if not self.optimizer.state:  # before the first update: nothing to shard (torch would take a step to make it)
            return weights, self.optimizer.state_dict(), None
        from torch.distributed.checkpoint.api import CheckpointException

        shards, failure = None, None
        if main:
            shards = scratch_name(folder / f"{STEP_PREFIX}{step:06d}")
            try:
                shards.mkdir(parents=True)
            except OSError as error:
                failure = f"{shards}: {error.strerror or error}"
        shards, failure = broadcast_object((str(shards) if main else None, failure))  # every rank stops, or none
        try:
            if failure is None:
                groups = save_optimizer_shards(self.model, self.optimizer, Path(shards))
        except (Exception, CheckpointException) as error:  # torch.distributed.checkpoint raises on every rank
            if main:
                shutil.rmtree(shards, ignore_errors=True)
            failure = str(error).strip().splitlines()[-1][:200] if str(error).strip() else type(error).__name__
        if failure is not None:
            raise CheckpointError(f"cannot write the optimiser's shards of checkpoint step {step} ({failure}); the "
                                  f"checkpoints before it are intact; free space or fix {folder} and resume")
        return weights, {"param_groups": groups, "shards": OPTIMIZER_SHARDS}, Path(shards)

    def save(self, folder: Path, config, tokenizer, snapshot: dict, keep: int,
             gathered: tuple[dict, dict, Optional[Path]]) -> None:
        """Write checkpoint `snapshot["step"]` of the `gathered()` weights and optimiser state under `folder`
        (RUN/checkpoints), then delete all but the newest `keep` (only once the new one is complete). A full disk
        is a DiskFullError that says what is intact."""
        step = snapshot["step"]
        counter, streams = snapshot["counter"], snapshot["streams"]
        weights, optimizer, shards = gathered
        state = {
            "step": step,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            "rng": snapshot["rng"],
            "skipped": snapshot["skipped"],
            # The scenes stream is a function of the step; a user stream continues from each rank's position.
            "data": {"step": step, **counter.as_dict(), **({"streams": streams} if streams is not None else {})},
        }
        folders = {OPTIMIZER_SHARDS: shards} if shards is not None else {}
        try:
            if self.adapters is not None:  # peft's own files, moved into the checkpoint with it
                from topoclip.model.lora import ADAPTERS, save_adapters

                folders[ADAPTERS] = save_adapters(self.adapters, scratch_name(folder / f"{STEP_PREFIX}{step:06d}"))
            save_checkpoint(folder / f"{STEP_PREFIX}{step:06d}", self.model, config, tokenizer, state, weights,
                            folders or None)
        except DiskFullError as error:
            earlier = [path for path in step_checkpoints(folder) if checkpoint_step(path) < step]
            intact = (f"the previous checkpoint step {checkpoint_step(earlier[-1])} ({earlier[-1]}) is intact"
                      if earlier else "there is no earlier checkpoint")
            raise DiskFullError(f"no space left on {error.path} while writing checkpoint step {step}; {intact}; free "
                                f"space and run `topoclip train --resume {folder.parent}`", error.path) from error
        prune_checkpoints(folder, keep)

    def restore(self, found: list[Path], main: bool) -> Path:
        """Restore from the newest of `found` that loads (weights, finite, and training state), falling back to the
        one before with a note when the newest is damaged; returns the checkpoint used."""
        for folder in reversed(found):
            try:
                self.restore_from(folder)
                return folder
            except CheckpointError as error:
                if folder == found[0]:
                    raise CheckpointError(f"no checkpoint of {folder.parent} can be resumed; the oldest: {error}") from None
                if main:
                    print(f"topoclip: note: skipping damaged checkpoint {folder.name} ({error}); trying the one before",
                          file=sys.stderr)
        raise AssertionError("unreachable: found is not empty")

    def restore_from(self, folder: Path) -> None:
        """Load weights and training state from one checkpoint folder. CheckpointError when the weights or the state
        cannot be read, or the weights are not finite."""
        if self.adapters is not None:  # the frozen base is in place: the adapters and what trains besides them
            from topoclip.model.lora import restore_adapted

            restore_adapted(self.adapters, read_weights(folder, self.model.config), folder)
        elif is_sharded(self.model):  # every rank reads the whole file and keeps its shards
            load_full_weights(self.model, read_weights(folder, self.model.config))
        else:
            load_weights(self.model, folder)
        if not parameters_finite(self.model):
            raise CheckpointError(f"{folder} holds inf/NaN weights")
        state = load_training_state(folder)
        check_training_state(state, self.optimizer, folder)
        try:
            self._apply(state, folder)
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError, AttributeError) as error:  # unforeseen
            raise CheckpointError(f"{folder / TRAINING_STATE} does not fit this run ({type(error).__name__}: "
                                  f"{str(error)[:120]})") from None

    def _apply(self, state: dict, folder: Path) -> None:
        optimizer, scheduler = self.optimizer, self.scheduler
        # The hyperparameters follow the *current* config (a resume may change train.lr, weight decay,
        # steps): keep the ones the optimizer was just built with, and recompute this step's lr.
        current = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
        if "shards" in state["optimizer"]:  # a sharded run's: every rank reads what its own shards need
            load_optimizer_shards(self.model, optimizer, folder / OPTIMIZER_SHARDS,
                                  state["optimizer"]["param_groups"])
        elif not state["optimizer"]["state"]:
            pass  # saved before the first update: the fresh optimiser is that state
        elif is_sharded(self.model):
            load_full_optimizer(self.model, optimizer, state["optimizer"])
        else:
            optimizer.load_state_dict(state["optimizer"])
        for group, settings in zip(optimizer.param_groups, current):
            group.update(settings)
        scheduler.load_state_dict(state["scheduler"])
        scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        for group, base, schedule in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * schedule(scheduler.last_epoch)
        if self.scaler is not None and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"]["torch"])
        if torch.cuda.is_available() and state["rng"]["cuda"]:
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        data = state["data"]
        self.counter += BadSampleCounter(data["kept"], data["bad"])
        self.step, self.streams, self.skipped = int(state["step"]), data.get("streams"), state.get("skipped", 0)


def check_training_state(state, optimizer, folder: Path) -> None:
    """CheckpointError unless `state` (a loaded training_state.pt) has every part with its type, and optimizer
    state for `optimizer`'s groups and parameters with their shapes: all is checked before anything is used."""
    def bad(what: str):
        return CheckpointError(f"{folder / TRAINING_STATE}: {what}; the file is damaged or from another run")

    expected = {"step": int, "optimizer": dict, "scheduler": dict, "scaler": dict, "rng": dict, "data": dict}
    if not isinstance(state, dict):
        raise bad(f"it holds a {type(state).__name__}, not the training state")
    for key, kind in expected.items():
        if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool):
            raise bad(f"{key!r} is missing or not a {kind.__name__}")
    if STEP_NAME.fullmatch(folder.name) and state["step"] != checkpoint_step(folder):  # a step-N folder holds step N
        raise bad(f"its step {state['step']} is not its folder's ({folder.name})")
    if state["step"] < 0:
        raise bad(f"step {state['step']} is negative")
    skipped = state.get("skipped", 0)
    if not isinstance(skipped, int) or isinstance(skipped, bool) or not 0 <= skipped <= state["step"]:
        raise bad(f"its count of skipped steps ({skipped!r:.40}) is not a whole number from 0 to its step")
    groups, saved = optimizer.param_groups, state["optimizer"].get("param_groups")
    if not isinstance(saved, list) or len(saved) != len(groups) or not all(
            isinstance(group, dict) and isinstance(group.get("params"), list) and len(group["params"]) == len(current["params"])
            for group, current in zip(saved, groups)):
        raise bad(f"its optimizer has other parameter groups than this model's {len(groups)}")
    if state["optimizer"].get("shards") == OPTIMIZER_SHARDS:  # the moments are checked as they load from the shards
        if not (folder / OPTIMIZER_SHARDS).is_dir():
            raise bad(f"its optimizer state is sharded but {folder / OPTIMIZER_SHARDS} is missing")
        check_rest(state, folder)
        return
    parameters = {index: parameter for group, current in zip(saved, groups)
                  for index, parameter in zip(group["params"], current["params"])}
    moments = state["optimizer"].get("state")
    if not isinstance(moments, dict):
        raise bad("its optimizer state is not a mapping")
    for index, values in moments.items():
        if index not in parameters or not isinstance(values, dict):
            raise bad(f"its optimizer holds state for parameter {index!r}, which this model does not have")
        for name, value in values.items():
            if not isinstance(value, torch.Tensor) or (value.dim() and value.shape != parameters[index].shape):
                raise bad(f"its optimizer's {name} of parameter {index} does not have the parameter's shape")
            if value.is_floating_point() and not torch.isfinite(value).all():  # bit rot: zip CRCs are not checked
                raise bad(f"its optimizer's {name} of parameter {index} holds inf/NaN")
    check_rest(state, folder)


def check_rest(state: dict, folder: Path) -> None:
    """check_training_state's checks of the RNG states, the data counts and the stream positions."""
    def bad(what: str):
        return CheckpointError(f"{folder / TRAINING_STATE}: {what}; the file is damaged or from another run")

    rng, data = state["rng"], state["data"]
    if not isinstance(rng.get("torch"), torch.Tensor) or rng["torch"].dtype != torch.uint8 or not isinstance(
            rng.get("cuda"), list):
        raise bad("its RNG state is not a byte tensor (and a list for CUDA)")
    if not isinstance(data.get("kept"), int) or not isinstance(data.get("bad"), dict) or not all(
            isinstance(kind, str) and isinstance(count, int) for kind, count in data["bad"].items()):
        raise bad("its data counts are not numbers by kind")
    streams = data.get("streams")
    if streams is not None and not (isinstance(streams, list) and streams and all(map(StreamPosition.is_state, streams))):
        raise bad("its data-stream positions are not a list of positions")
