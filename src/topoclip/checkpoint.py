"""Checkpoints: a folder with the weights (safetensors), the resolved config, the tokenizer and,
for training, the optimizer/scheduler/RNG/data state (torch.save, loaded with weights_only=True).

    step-000200/
      model.safetensors     weights only, never pickled
      config.json           the resolved Config
      tokenizer.json        the tokenizer the model was trained with
      training_state.pt     optimizer, scheduler, step, RNG states, data position (resume only)

A checkpoint is written to a temporary sibling folder and renamed into place, so a killed run
never leaves a half-written checkpoint under its final name.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from topoclip.config import Config, from_dict, to_dict, validate
from topoclip.model import CLIP

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
TRAINING_STATE = "training_state.pt"
STEP_PREFIX = "step-"


def save_checkpoint(path: Path, model: CLIP, config: Config, tokenizer=None,
                    training_state: Optional[dict] = None) -> Path:
    """Write a checkpoint folder atomically (temporary folder + rename). Returns `path`."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    # safetensors refuses shared storage; clone to contiguous, independent tensors.
    state = {name: tensor.detach().contiguous().cpu() for name, tensor in model.state_dict().items()}
    save_file(state, temporary / WEIGHTS, metadata={"format": "pt", "topoclip": "1"})
    (temporary / CONFIG).write_text(json.dumps(to_dict(config), indent=2))
    if tokenizer is not None:
        tokenizer.save(temporary / TOKENIZER)
    if training_state is not None:
        torch.save(training_state, temporary / TRAINING_STATE)
    if path.exists():  # re-saving the same step: replace it
        shutil.rmtree(path)
    os.replace(temporary, path)
    return path


def step_checkpoints(folder: Path) -> list[Path]:
    """Complete step checkpoints under `folder`, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX)
             and not p.name.endswith(".tmp") and (p / WEIGHTS).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX):]))


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint folder from a checkpoint folder, a run folder (its latest) or a weights file."""
    path = Path(path)
    if path.is_file() and path.name == WEIGHTS:
        path = path.parent
    if (path / WEIGHTS).is_file():
        return path
    for folder in (path / "checkpoints", path):
        found = step_checkpoints(folder)
        if found:
            return found[-1]
    raise FileNotFoundError(f"no checkpoint at {path}: expected a folder with {WEIGHTS}, or a run folder with "
                            f"checkpoints/{STEP_PREFIX}NNNNNN/")


def load_config_from(path: Path) -> Config:
    config = from_dict(Config, json.loads((Path(path) / CONFIG).read_text()))
    validate(config)
    return config


def load_weights(model: CLIP, folder: Path) -> None:
    """Load a checkpoint folder's safetensors weights into `model` (on the model's device)."""
    device = str(next(model.parameters()).device)
    missing, unexpected = model.load_state_dict(load_file(Path(folder) / WEIGHTS, device=device), strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {folder} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def load_checkpoint(path, map_location: str = "cpu"):
    """(model, tokenizer or None, config) from a checkpoint (see `resolve_checkpoint`)."""
    folder = resolve_checkpoint(Path(path))
    config = load_config_from(folder)
    model = CLIP(config.model).to(map_location)
    load_weights(model, folder)
    tokenizer = None
    if (folder / TOKENIZER).is_file():
        from topoclip.tokenizer import Tokenizer

        tokenizer = Tokenizer.load(folder / TOKENIZER)
    return model, tokenizer, config


def load_training_state(path: Path) -> dict:
    """The resume state; weights_only=True, so nothing in the file is executed."""
    return torch.load(Path(path) / TRAINING_STATE, map_location="cpu", weights_only=True)


def prune_checkpoints(folder: Path, keep: int) -> None:
    """Delete all but the newest `keep` step checkpoints (and stale temporary folders)."""
    for stale in Path(folder).glob(f"{STEP_PREFIX}*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    for old in step_checkpoints(folder)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
