"""Saving and resuming a run: what a resume may change (RESUMABLE_SETTINGS), whether a run is finished,
writing a step checkpoint (weights, optimiser, scheduler, RNG and data position), and loading the newest good
one back. Only rank 0 writes; every rank resumes from the same checkpoint."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from topoclip.checkpoint import (CONFIG, STEP_PREFIX, TRAINING_STATE, check_weights_fit, load_config_from, load_training_state,
                                 load_weights, prune_checkpoints, save_checkpoint, step_checkpoints)
from topoclip.config import (FOLDER_GUARDED, Config, ConfigError, flat_dict, override_value, refuse_folder_commands,
                             to_dict)
from topoclip.data.quality import BadSampleCounter
from topoclip.errors import CheckpointError, DiskFullError, RunFolderError
from topoclip.training.data import StreamPosition
from topoclip.training.logger import MetricsLogger
from topoclip.run_folder import RunFolder
from topoclip.training.guard import parameters_finite

# What a resume may change ("section.*": every key of the section). The rest (the model's shape, the
# data and its order, the batch, the seed, the loss, the optimiser's betas/eps) is fixed by the checkpoint.
RESUMABLE_SETTINGS = ("name", "train.steps", "train.lr", "train.warmup_steps", "train.weight_decay",
                      "train.grad_clip", "train.log_every", "train.eval_every", "train.checkpoint_every",
                      "train.keep_checkpoints", "train.device", "train.threads", "train.num_workers",
                      "train.precision", "train.compile", "train.gradient_checkpointing", "train.accumulation_steps",
                      "train.allow_tf32", "train.fused_optimizer", "train.report_to",
                      "model.temperature.max_scale", "data.max_bad_fraction", "evaluate.*")


def flat_settings(config: Config) -> dict[str, Any]:
    """{"train.lr": 0.0005, "model.vision.width": 768, ...}: every leaf setting by its dotted key."""
    return flat_dict(to_dict(config))


def resumable(key: str) -> bool:
    """Whether a resume may change the setting `key` (see RESUMABLE_SETTINGS)."""
    return any(key == allowed or (allowed.endswith(".*") and key.startswith(allowed[:-1]))
               for allowed in RESUMABLE_SETTINGS)


def resume_config(run_dir, config: Optional[Config] = None, overrides: Sequence[str] = ()) -> Config:
    """The config a resume of `run_dir` trains with: its saved config, or `config` if it changes only
    RESUMABLE_SETTINGS of it. RunFolderError / CheckpointError / ConfigError otherwise, before anything is written.

    The saved config is the folder's, so it may not run a command or reach the network (config.refuse_folder_commands)
    unless the user typed that value (`overrides`, the command line's --set); a `config` given is the caller's own.
    """
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG).is_file():
        raise RunFolderError(f"cannot resume {run_dir}: no {CONFIG} there; give the run folder of an earlier run")
    saved = load_config_from(run_dir)
    if config is None:
        typed = {key: override_value(list(overrides), key) for key in FOLDER_GUARDED}
        refuse_folder_commands(saved, run_dir / CONFIG, typed)
        return saved
    before, after = flat_settings(saved), flat_settings(config)
    changed = [key for key in sorted(set(before) | set(after)) if before.get(key) != after.get(key)]
    refused = [key for key in changed if not resumable(key)]
    if refused:
        shown = "; ".join(f"{key} {before.get(key)!r} -> {after.get(key)!r}" for key in refused[:3])
        raise ConfigError(f"--resume cannot change {shown}{'; ...' if len(refused) > 3 else ''}: the checkpoint's "
                          f"weights, optimiser state or data order depend on it (start a new run with --out for that); "
                          f"a resume may change only {', '.join(RESUMABLE_SETTINGS)}")
    return config


def checkpoint_step(folder: Path) -> int:
    """The step of a checkpoint folder `step-NNNNNN`."""
    return int(Path(folder).name[len(STEP_PREFIX):])


def finished(run_dir: Path, config: Config) -> Optional[str]:
    """A one-line note when the run in `run_dir` has trained all train.steps and was evaluated, else None.

    ConfigError when train.steps is below the newest checkpoint's step (nothing could be trained).
    """
    folder, steps = RunFolder(run_dir), config.train.steps
    newest = folder.newest_step()
    if newest is None:
        return None
    if newest > steps:
        raise ConfigError(f"train.steps={steps} is below step {newest} of the newest checkpoint in {run_dir}; "
                          f"to train it longer set train.steps above {newest}")
    if folder.finished(steps):
        return (f"run {run_dir} is complete: it trained all {steps} steps and was evaluated (eval.json); nothing to do. "
                f"To train it longer: topoclip train --resume {run_dir} --set train.steps=N (N > {steps})")
    return None


def finish_leftovers(run_dir: Path, config: Config) -> None:
    """What a run killed after writing eval.json left undone: the final record in metrics.jsonl, the plots."""
    from topoclip.evaluation.run import headline, read_evaluation
    from topoclip.run_folder import read_metrics

    records = read_evaluation(RunFolder(run_dir).evaluation)
    logger = MetricsLogger(run_dir, report_to=())  # metrics.jsonl and plots only: no reporter opens a new log
    if not any(record.get("final") for record in read_metrics(logger.path)):
        logger.log({"step": config.train.steps, "eval": headline(records), "final": True})
    if not all((RunFolder(run_dir).plots / f"{name}.png").is_file() for name in ("loss", "evaluation")):
        print(f"topoclip: note: drawing the plots of {run_dir}, which its run did not finish", file=sys.stderr)
        logger.plot()
    logger.close()


def rng_states() -> dict:
    """This process's torch RNG states (CPU and every CUDA device), as a checkpoint stores them."""
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def save_checkpoint_and_prune(folder: Path, model, config, tokenizer, optimizer, scheduler, scaler, *, step: int,
                              counter: BadSampleCounter, rng: dict, keep: int, streams: Optional[list] = None) -> None:
    """Write checkpoint `step`, then delete all but the newest `keep` (only once the new one is complete)."""
    write_checkpoint(folder, step, model, config, tokenizer, optimizer, scheduler, scaler, counter, rng, streams)
    prune_checkpoints(folder, keep)


def write_checkpoint(folder: Path, step: int, model, config, tokenizer, optimizer, scheduler, scaler, counter,
                     rng: Optional[dict] = None, streams: Optional[list] = None) -> None:
    """Save checkpoint `step` under `folder`; a full disk is a DiskFullError that says what is intact.

    rng: the RNG states as of `step` (default: now); counter: the data counts as of `step`;
    streams: each rank's StreamPosition.state() as of `step` (user data; None for the scenes).
    """
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else {},
        "rng": rng if rng is not None else rng_states(),
        # The scenes stream is a function of the step; a user stream continues from each rank's position.
        "data": {"step": step, **counter.as_dict(), **({"streams": streams} if streams is not None else {})},
    }
    try:
        save_checkpoint(folder / f"{STEP_PREFIX}{step:06d}", model, config, tokenizer, state)
    except DiskFullError as error:
        earlier = [path for path in step_checkpoints(folder) if checkpoint_step(path) < step]
        intact = (f"the previous checkpoint step {checkpoint_step(earlier[-1])} ({earlier[-1]}) is intact" if earlier
                  else "there is no earlier checkpoint")
        raise DiskFullError(f"no space left on {error.path} while writing checkpoint step {step}; {intact}; free space "
                            f"and run `topoclip train --resume {folder.parent}`", error.path) from error


def require_fitting_checkpoint(found: list[Path], model_config) -> None:
    """The newest error of check_weights_fit when no checkpoint of `found` fits `model_config` (nothing allocated)."""
    errors = []
    for folder in reversed(found):
        try:
            return check_weights_fit(folder, model_config)
        except CheckpointError as error:
            errors.append(error)
    raise errors[0]


def resume_newest_good(found: list[Path], model, optimizer, scheduler, scaler, counter: BadSampleCounter,
                       main: bool) -> tuple[int, Path, Optional[list]]:
    """Resume from the newest of `found` that loads (weights, finite, and training state), falling back to
    the one before with a note when the newest is damaged; returns (step, the checkpoint used, the ranks'
    stream positions or None)."""
    for folder in reversed(found):
        try:
            step, streams = resume_from(folder, model, optimizer, scheduler, scaler, counter)
            return step, folder, streams
        except CheckpointError as error:
            if folder == found[0]:
                raise CheckpointError(f"no checkpoint of {folder.parent} can be resumed; the oldest: {error}") from None
            if main:
                print(f"topoclip: note: skipping damaged checkpoint {folder.name} ({error}); trying the one before",
                      file=sys.stderr)
    raise AssertionError("unreachable: found is not empty")


def resume_from(folder: Path, model, optimizer, scheduler, scaler, counter: BadSampleCounter) -> tuple[int, Optional[list]]:
    """Load weights and training state from a checkpoint folder; returns (the step to continue from, each
    rank's data-stream position, or None when the checkpoint has none: the scenes, or an older topoclip).

    CheckpointError when the weights or the state cannot be read, or the weights are not finite.
    """
    load_weights(model, folder)
    if not parameters_finite(model):
        raise CheckpointError(f"{folder} holds inf/NaN weights")
    state = load_training_state(folder)
    check_training_state(state, optimizer, folder)
    try:
        return _apply_training_state(state, optimizer, scheduler, scaler, counter)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError, AttributeError) as error:  # what no check foresaw
        raise CheckpointError(f"{folder / TRAINING_STATE} does not fit this run ({type(error).__name__}: "
                              f"{str(error)[:120]})") from None


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


def _apply_training_state(state: dict, optimizer, scheduler, scaler, counter: BadSampleCounter):
    # The hyperparameters follow the *current* config (a resume may change train.lr, weight decay,
    # steps): keep the ones the optimizer was just built with, and recompute this step's lr.
    current = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(state["optimizer"])
    for group, settings in zip(optimizer.param_groups, current):
        group.update(settings)
    scheduler.load_state_dict(state["scheduler"])
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    for group, base, schedule in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * schedule(scheduler.last_epoch)
    if scaler is not None and state["scaler"]:
        scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["torch"])
    if torch.cuda.is_available() and state["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    data = state["data"]
    counter += BadSampleCounter(data["kept"], data["bad"])
    return int(state["step"]), data.get("streams")
