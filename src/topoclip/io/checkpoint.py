"""Checkpoints: a folder with the weights (safetensors), the resolved config, the tokenizer and,
for training, the optimizer/scheduler/RNG/data state (torch.save, loaded with weights_only=True).

    step-000200/
      model.safetensors     weights only, never pickled
      config.json           the resolved Config
      tokenizer.json        the tokenizer the model was trained with
      training_state.pt     optimizer, scheduler, step, RNG states, data position (resume only)

A checkpoint is written to a new scratch sibling folder (topoclip.core.atomic.scratch_name) and renamed into place, so a killed run
never leaves a half-written checkpoint under its final name; a full disk removes the temporary
folder and raises DiskFullError. Weights with an inf/NaN are never written (NonFiniteError).
Reading a checkpoint that is malformed or does not fit its model raises CheckpointError.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from topoclip.core.atomic import SCRATCH_SUFFIX, scratch_name
from topoclip.config import Config, ConfigError, from_dict, to_dict, validate
from topoclip.core.door import check_inside, is_folder, is_regular, list_folder, read_json, regular_file, torch_archive
from topoclip.core.errors import CheckpointError, DiskFullError, NonFiniteError, is_disk_full
from topoclip.model.clip import CLIP
from topoclip.preprocess.tokenizer import SAVED_FILE_NAME

# A model folder's files. The config: not "config.json": on the Hugging Face Hub that name is transformers' (OpenCLIP
# names its own open_clip_config.json for the same reason). Folders written before hold CONFIG and are still read.
MODEL_CONFIG = "topoclip_config.json"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TOKENIZER = SAVED_FILE_NAME
TRAINING_STATE = "training_state.pt"
OPTIMIZER_SHARDS = "optimizer"  # a sharded run's optimiser state: one safetensors file a rank (training.sharding)
# A run keeps its step checkpoints in RUN/CHECKPOINTS/STEP_PREFIX + the step in six digits (topoclip.io.run_folder).
CHECKPOINTS = "checkpoints"
STEP_PREFIX = "step-"


def config_file(folder) -> Path:
    """The config file of a model or run folder: MODEL_CONFIG, else (earlier layout, run folders) CONFIG."""
    folder = Path(folder)
    return folder / MODEL_CONFIG if (folder / MODEL_CONFIG).exists() or not (folder / CONFIG).exists() \
        else folder / CONFIG


def save_checkpoint(path: Path, model: CLIP, config: Config, tokenizer=None,
                    training_state: Optional[dict] = None, weights: Optional[dict] = None,
                    folders: Optional[dict[str, Path]] = None) -> Path:
    """Write a checkpoint folder atomically (temporary folder + rename). Returns `path`.

    weights: the model's state dict when `model.state_dict()` is not it (a sharded model's, gathered).
    folders: {name: folder} moved into the checkpoint before the rename (written by every rank: the optimiser's
        shards); removed with the rest when the save fails.
    Raises NonFiniteError (nothing written) when a weight holds inf/NaN, and DiskFullError (the
    temporary folder removed, any earlier checkpoint untouched) when the disk fills up.
    """
    path = Path(path)
    # safetensors refuses shared storage; clone to contiguous, independent tensors.
    weights = model.state_dict() if weights is None else weights
    state = {name: tensor.detach().contiguous().cpu() for name, tensor in weights.items()}
    broken = [name for name, tensor in state.items() if tensor.is_floating_point() and not torch.isfinite(tensor).all()]
    if broken:
        for folder in (folders or {}).values():
            shutil.rmtree(folder, ignore_errors=True)
        raise NonFiniteError(f"not writing checkpoint {path}: {len(broken)} of {len(state)} tensors hold inf/NaN "
                             f"({', '.join(broken[:3])}{', ...' if len(broken) > 3 else ''})")
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = scratch_name(path)
    try:
        temporary.mkdir()  # a new name (FileExistsError otherwise): never a folder of the user's
        save_file(state, temporary / WEIGHTS, metadata={"format": "pt", "topoclip": "1"})
        (temporary / MODEL_CONFIG).write_text(json.dumps(to_dict(config), indent=2))
        if tokenizer is not None:
            tokenizer.save(temporary / TOKENIZER)
        if training_state is not None:
            with open(temporary / TRAINING_STATE, "wb", buffering=0) as handle:
                torch.save(training_state, _WholeWrites(handle))
        for name, folder in (folders or {}).items():
            os.replace(folder, temporary / name)
    except (OSError, RuntimeError, SafetensorError, KeyboardInterrupt) as error:
        shutil.rmtree(temporary, ignore_errors=True)  # frees the space the partial files took
        for folder in (folders or {}).values():
            shutil.rmtree(folder, ignore_errors=True)
        if is_disk_full(error):
            raise DiskFullError(f"no space left on {path.parent} while writing checkpoint {path.name}",
                                path.parent) from error
        if isinstance(error.__context__, KeyboardInterrupt):  # Ctrl-C mid torch.save: its zip writer's cleanup
            raise error.__context__  # fails ("unexpected pos") and hides the interrupt; say the interrupt
        raise
    try:
        if path.exists():  # re-saving the same step, or an empty destination folder: replace it
            shutil.rmtree(path)
        os.replace(temporary, path)
    except OSError:
        shutil.rmtree(temporary, ignore_errors=True)  # nothing of a failed save stays behind
        raise
    return path


class _WholeWrites:
    """A file object for torch.save whose write() writes everything or raises the OSError.

    torch.save on a path turns a full disk into "RuntimeError: ... unexpected pos"; writing
    through this unbuffered writer keeps the OSError (errno ENOSPC) that says what happened.
    """

    def __init__(self, handle):
        self.handle = handle

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        while view:
            view = view[self.handle.write(view):]
        return size

    def flush(self) -> None:
        self.handle.flush()


def checkpoint_step(folder: Path) -> int:
    """The step of a checkpoint folder `step-NNNNNN`."""
    return int(Path(folder).name[len(STEP_PREFIX):])


def step_checkpoints(folder: Path, root: Optional[Path] = None) -> list[Path]:
    """Complete step checkpoints under `folder`, oldest first (listed through the door: a link out of `folder`, or out
    of `root`, the run folder that holds it, is no checkpoint of it)."""
    folder = Path(folder)
    if root is not None:
        check_inside(folder, root, "the checkpoints folder", CheckpointError)
    if not is_folder(folder):
        return []
    found = [Path(entry.path) for entry in list_folder(folder, "checkpoints folder", error=CheckpointError)
             if STEP_NAME.fullmatch(entry.name) and is_folder(entry.path, folder) and is_regular(Path(entry.path) / WEIGHTS, folder)]
    return sorted(found, key=checkpoint_step)


STEP_NAME = re.compile(re.escape(STEP_PREFIX) + r"[0-9]{1,12}")  # step-000200; a scratch or .tmp name is no checkpoint


def transformers_folder(path: Path) -> bool:
    """Whether `path` is a transformers CLIPModel folder rather than a topoclip one (read by convert.hf)."""
    from topoclip.io.convert.hf_layout import is_hf_clip

    return path.is_dir() and not (path / MODEL_CONFIG).is_file() and is_hf_clip(path)


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint folder from a checkpoint folder, a run folder (its latest) or a weights file."""
    path = Path(path)
    if path.is_file() and path.name == WEIGHTS:
        path = path.parent
    if (path / WEIGHTS).exists() or transformers_folder(path):  # a FIFO or link there: refused by the door, said
        return path
    for folder in (path / CHECKPOINTS, path):
        found = step_checkpoints(folder, path)
        if found:
            return found[-1]
    raise FileNotFoundError(f"no checkpoint at {path}: expected a folder with {WEIGHTS}, or a run folder with "
                            f"checkpoints/{STEP_PREFIX}NNNNNN/")


def load_config_from(path: Path) -> Config:
    """The validated Config of a checkpoint or run folder (read through the door); CheckpointError when its config is
    unreadable."""
    file = config_file(path)
    try:
        values = read_json(file, "the config", Path(path), expect=dict, error=CheckpointError)
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no {MODEL_CONFIG} (nor {CONFIG}); it is not a topoclip model or run "
                              f"folder") from None
    try:
        config = from_dict(Config, values)
        validate(config)
    except ConfigError as error:
        raise CheckpointError(f"{file}: {error}") from None
    return config


@contextmanager
def _damaged_as_checkpoint_error(file: Path):
    """A safetensors file that cannot be read (cut short, not safetensors) is a CheckpointError; a missing one is not."""
    try:
        yield
    except (SafetensorError, OSError) as error:
        if isinstance(error, FileNotFoundError):
            raise
        raise CheckpointError(f"{file} cannot be read as safetensors ({error}); the checkpoint is damaged") from None


def optional_part(name: str, optional: tuple[str, ...]) -> bool:
    """Whether tensor `name` is one of `optional`'s: under an entry ending in ".", or equal to another."""
    return any(name.startswith(part) if part.endswith(".") else name == part for part in optional)


def check_weights_fit(folder: Path, model_config, optional: tuple[str, ...] = ()) -> None:
    """CheckpointError naming the first difference between `folder`'s weights and the model `model_config`
    describes, read from the safetensors header and a model on the meta device: nothing is allocated, so a
    config.json that claims a huge model costs nothing before it is refused. Tensors whose names start with one of
    `optional` may be missing from the file or extra in it (a run's own new parts, see `read_weights`): an entry ending
    in "." names every tensor under it, any other one tensor."""
    file = regular_file(Path(folder) / WEIGHTS, "the weights", Path(folder), error=CheckpointError)
    with _damaged_as_checkpoint_error(file), safe_open(file, framework="pt") as weights:  # the header only
        found = {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
    with torch.device("meta"):  # shapes without memory
        expected = {name: tuple(tensor.shape) for name, tensor in CLIP(model_config).state_dict().items()}
    where = f"{file} does not fit the model its config.json describes"
    for name, shape in expected.items():
        if name not in found:
            if optional_part(name, optional):
                continue
            raise CheckpointError(f"{where}: {name} {shape} is missing from the file")
        if found[name] != shape:
            raise CheckpointError(f"{where}: {name} is {found[name]} in the file but {shape} in the config")
    extra = sorted(name for name in set(found) - set(expected) if not optional_part(name, optional))
    if extra:
        raise CheckpointError(f"{where}: the file has {len(extra)} tensors the model lacks, e.g. {extra[0]}")


def first_non_finite(folder: Path) -> Optional[str]:
    """The first tensor of a checkpoint folder's weights holding a NaN or an infinity, else None: read one tensor at
    a time (memory of the largest one), after check_weights_fit has checked the header."""
    file = regular_file(Path(folder) / WEIGHTS, "the weights", Path(folder), error=CheckpointError)
    with _damaged_as_checkpoint_error(file), safe_open(file, framework="pt") as weights:
        return next((name for name in weights.keys() if not torch.isfinite(weights.get_tensor(name)).all()), None)


def stored_scalar(folder: Path, name: str) -> Optional[float]:
    """The 0-d tensor `name` of a checkpoint folder's weights as a float (None when the file has no such tensor), read
    alone from the safetensors file."""
    file = regular_file(Path(folder) / WEIGHTS, "the weights", Path(folder), error=CheckpointError)
    with _damaged_as_checkpoint_error(file), safe_open(file, framework="pt") as weights:
        if name not in weights.keys() or weights.get_slice(name).get_shape() != []:
            return None
        return float(weights.get_tensor(name))


def load_weights(model: CLIP, folder: Path) -> None:
    """Load a checkpoint folder's safetensors weights into `model` (on the model's device).

    CheckpointError when the file cannot be read or does not fit the model (see check_weights_fit).
    """
    model.load_state_dict(read_weights(folder, model.config, str(next(model.parameters()).device)))


def read_weights(folder: Path, model_config, device: str = "cpu", optional: tuple[str, ...] = ()) -> dict:
    """A checkpoint folder's safetensors weights, checked to fit a model of `model_config` (check_weights_fit); the
    tensors under `optional` that the model lacks are left out (those it has and the file lacks stay as built)."""
    check_weights_fit(folder, model_config, optional)
    file = regular_file(Path(folder) / WEIGHTS, "the weights", Path(folder), error=CheckpointError)
    with _damaged_as_checkpoint_error(file):
        weights = load_file(file, device=device)
    if optional:
        with torch.device("meta"):
            names = set(CLIP(model_config).state_dict())
        weights = {name: tensor for name, tensor in weights.items() if name in names}
    return weights


def load_tokenizer_from(folder: Path, text_config=None):
    """The Tokenizer saved in a checkpoint folder, or None; CheckpointError when tokenizer.json is malformed or,
    given the model's `text_config`, gives ids past its vocabulary (its context length is then the model's)."""
    file = Path(folder) / TOKENIZER
    if not file.exists():
        return None
    from topoclip.preprocess.tokenizer import Tokenizer

    check_inside(file, folder, "the tokenizer", CheckpointError)
    try:
        tokenizer = Tokenizer.load(file, None if text_config is None else text_config.context_length)
    except ValueError as error:  # the tokenizer's messages name the file and what is wrong
        raise CheckpointError(str(error)) from None
    if text_config is not None and tokenizer.id_bound > text_config.vocab_size:
        raise CheckpointError(f"{file} gives token ids up to {tokenizer.id_bound - 1} but the model's text embedding "
                              f"has {text_config.vocab_size} rows: the tokenizer is not the model's")
    return tokenizer


def load_checkpoint(path, map_location: str = "cpu"):
    """(model, tokenizer or None, config) from a checkpoint (see `resolve_checkpoint`), or from a transformers
    CLIPModel folder (converted in memory: topoclip.io.convert.hf)."""
    if transformers_folder(Path(path)):
        from topoclip.io.convert.hf import import_hf

        model, tokenizer, config = import_hf(path)
        return model.to(map_location), tokenizer, config
    folder = resolve_checkpoint(Path(path))
    config = load_config_from(folder)
    check_weights_fit(folder, config.model)  # before the model is built from a config anyone may have written
    model = CLIP(config.model).to(map_location)
    load_weights(model, folder)
    return model, load_tokenizer_from(folder, config.model.text), config


def load_training_state(path: Path) -> dict:
    """The resume state; weights_only=True, so nothing in the file is executed.

    CheckpointError when the file is damaged (the checkpoint before it can be resumed instead).
    """
    file = Path(path) / TRAINING_STATE
    damaged = "move this checkpoint folder away to resume from the one before"
    try:
        with torch_archive(file, "the training state", Path(path), CheckpointError) as handle:
            return torch.load(handle, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{Path(path)} has no {TRAINING_STATE}; it holds weights only and cannot be resumed") from None
    except CheckpointError as error:
        raise CheckpointError(f"{error}; {damaged}") from None
    except Exception as error:  # a damaged zip or a payload weights_only refuses: never executed
        raise CheckpointError(f"{file} cannot be read ({type(error).__name__}: {str(error).splitlines()[0][:200]}); "
                              f"{damaged}") from None


def prune_checkpoints(folder: Path, keep: int) -> None:
    """Delete all but the newest `keep` step checkpoints (and stale temporary folders)."""
    # Scratch folders of checkpoints a killed run was writing (and, from before scratch_name, step-*.tmp):
    # inside a run's own checkpoints/ folder, so only ever topoclip's.
    for entry in list_folder(folder, "checkpoints folder", error=CheckpointError):
        if (entry.name.startswith(f".{STEP_PREFIX}") and entry.name.endswith(SCRATCH_SUFFIX)) or (
                entry.name.startswith(STEP_PREFIX) and entry.name.endswith(".tmp")):
            shutil.rmtree(entry.path, ignore_errors=True)  # (a link is never followed: rmtree refuses one)
    for old in step_checkpoints(folder)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
