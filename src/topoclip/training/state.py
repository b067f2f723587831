"""A run's training state as one object (`TrainState`): the model, its optimiser, lr schedule and loss scaler, the
data counts, the step and this rank's stream position. A step checkpoint saves it (weights as safetensors, the
rest in training_state.pt) and a resume restores it from the newest checkpoint that loads, checked before use.
Only rank 0 writes; every rank restores from the same checkpoint."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from topoclip.checkpoint import (STEP_PREFIX, TRAINING_STATE, checkpoint_step, load_training_state, load_weights,
                                 prune_checkpoints, read_weights, save_checkpoint, step_checkpoints)
from topoclip.data.quality import BadSampleCounter
from topoclip.data.streams import StreamPosition
from topoclip.distributed import is_sharded
from topoclip.errors import CheckpointError, DiskFullError
from topoclip.training.guard import parameters_finite
from topoclip.training.sharding import full_state, load_full_optimizer, load_full_weights


def rng_states() -> dict:
    """This process's torch RNG states (CPU and every CUDA device), as a checkpoint stores them."""
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


@dataclass
class TrainState:
    """Everything a step checkpoint saves and a resume restores.

    step: the steps trained; streams: after `restore`, every rank's data-stream position as the checkpoint saved
    them (user data), or None (the built-in scenes are a function of the step; an older topoclip saved none).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: Optional[torch.amp.GradScaler]
    counter: BadSampleCounter = field(default_factory=BadSampleCounter)
    step: int = 0
    streams: Optional[list] = None

    def snapshot(self, step: int, streams: Optional[list]) -> dict:
        """What a checkpoint of `step` saves besides the live objects, as of now: the data counts (copied), the RNG
        states and every rank's stream position (None for the scenes)."""
        return {"step": step, "counter": BadSampleCounter(self.counter.kept, self.counter.bad), "rng": rng_states(),
                "streams": streams}

    def gathered(self) -> tuple[dict, dict]:
        """(weights, optimiser state) as one process's state_dict()s: what a checkpoint saves. A sharded model's are
        gathered to rank 0 (a collective: every rank calls this)."""
        if is_sharded(self.model):
            return full_state(self.model, self.optimizer)
        return self.model.state_dict(), self.optimizer.state_dict()

    def save(self, folder: Path, config, tokenizer, snapshot: dict, keep: int, gathered: tuple[dict, dict]) -> None:
        """Write checkpoint `snapshot["step"]` of the `gathered()` weights and optimiser state under `folder`
        (RUN/checkpoints), then delete all but the newest `keep` (only once the new one is complete). A full disk
        is a DiskFullError that says what is intact."""
        step = snapshot["step"]
        counter, streams = snapshot["counter"], snapshot["streams"]
        weights, optimizer = gathered
        state = {
            "step": step,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            "rng": snapshot["rng"],
            # The scenes stream is a function of the step; a user stream continues from each rank's position.
            "data": {"step": step, **counter.as_dict(), **({"streams": streams} if streams is not None else {})},
        }
        try:
            save_checkpoint(folder / f"{STEP_PREFIX}{step:06d}", self.model, config, tokenizer, state, weights)
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
        if is_sharded(self.model):  # every rank reads the whole file and keeps its shards
            load_full_weights(self.model, read_weights(folder, self.model.config))
        else:
            load_weights(self.model, folder)
        if not parameters_finite(self.model):
            raise CheckpointError(f"{folder} holds inf/NaN weights")
        state = load_training_state(folder)
        check_training_state(state, self.optimizer, folder)
        try:
            self._apply(state)
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError, AttributeError) as error:  # unforeseen
            raise CheckpointError(f"{folder / TRAINING_STATE} does not fit this run ({type(error).__name__}: "
                                  f"{str(error)[:120]})") from None

    def _apply(self, state: dict) -> None:
        optimizer, scheduler = self.optimizer, self.scheduler
        # The hyperparameters follow the *current* config (a resume may change train.lr, weight decay,
        # steps): keep the ones the optimizer was just built with, and recompute this step's lr.
        current = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
        if is_sharded(self.model):
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
        self.step, self.streams = int(state["step"]), data.get("streams")


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
    if state["step"] < 0:
        raise bad(f"step {state['step']} is negative")
    groups, saved = optimizer.param_groups, state["optimizer"].get("param_groups")
    if not isinstance(saved, list) or len(saved) != len(groups) or not all(
            isinstance(group, dict) and isinstance(group.get("params"), list) and len(group["params"]) == len(current["params"])
            for group, current in zip(saved, groups)):
        raise bad(f"its optimizer has other parameter groups than this model's {len(groups)}")
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
