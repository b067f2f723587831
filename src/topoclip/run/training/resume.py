"""Resuming a run, its policy: what a resume may change (RESUMABLE_SETTINGS), whether a run is finished, what a
run killed after its evaluation left undone, and whether any checkpoint fits the config. The state a checkpoint
saves and a resume restores is training.state."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence


from topoclip.io.checkpoint import check_weights_fit, load_config_from
from topoclip.config import (FOLDER_GUARDED, Config, ConfigError, flat_dict, override_value, refuse_folder_commands,
                             to_dict)
from topoclip.core.errors import CheckpointError, RunFolderError
from topoclip.run.training.logger import MetricsLogger
from topoclip.io.run_folder import CONFIG, RunFolder

# What a resume may change ("section.*": every key of the section). The rest (the model's shape, the
# data and its order, the batch, the seed, the loss, the optimiser's betas/eps) is fixed by the checkpoint.
RESUMABLE_SETTINGS = ("name", "train.steps", "train.lr", "train.warmup_steps", "train.weight_decay",
                      "train.grad_clip", "train.log_every", "train.eval_every", "train.checkpoint_every",
                      "train.keep_checkpoints", "train.device", "train.threads", "train.num_workers",
                      "train.precision", "train.compile", "train.gradient_checkpointing", "train.accumulation_steps",
                      "train.parallelism",
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
    if not os.path.lexists(run_dir / CONFIG):  # (one there that is no regular file is refused by the door, said)
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
    from topoclip.run.evaluation.run import headline, read_evaluation
    from topoclip.io.run_folder import read_metrics

    records = read_evaluation(RunFolder(run_dir).evaluation)
    logger = MetricsLogger(run_dir, report_to=())  # metrics.jsonl and plots only: no reporter opens a new log
    if not any(record.get("final") for record in read_metrics(logger.path)):
        logger.log({"step": config.train.steps, "eval": headline(records), "final": True})
    if not all((RunFolder(run_dir).plots / f"{name}.png").is_file() for name in ("loss", "evaluation")):
        print(f"topoclip: note: drawing the plots of {run_dir}, which its run did not finish", file=sys.stderr)
        logger.plot()
    logger.close()


def require_fitting_checkpoint(found: list[Path], model_config) -> None:
    """The newest error of check_weights_fit when no checkpoint of `found` fits `model_config` (nothing allocated)."""
    errors = []
    for folder in reversed(found):
        try:
            return check_weights_fit(folder, model_config)
        except CheckpointError as error:
            errors.append(error)
    raise errors[0]
