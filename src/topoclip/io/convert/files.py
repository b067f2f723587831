"""Read a foreign checkpoint's tensors without ever running code from the file.

safetensors files are read as they are; ``.pt``/``.bin``/``.pth`` files go through
``torch.load(weights_only=True)``, whose unpickler accepts tensors, containers and numbers only: a
file holding any other Python object (e.g. one whose ``__reduce__`` would run a command) is refused
before that object is built. TorchScript archives (OpenAI's original ``ViT-B-16.pt``) are refused
too: OpenCLIP publishes the same weights as safetensors.
"""
from __future__ import annotations

import pickle
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Union

import torch

from topoclip.config import ConfigError
from topoclip.core.door import check_inside, is_empty, regular_file, torch_archive
from topoclip.core.atomic import scratch_folder
from topoclip.core.errors import CheckpointError

# Inside a folder (e.g. a Hugging Face snapshot), the weights file is the first of these found.
WEIGHT_FILES = ("model.safetensors", "open_clip_model.safetensors", "open_clip_pytorch_model.bin",
                "pytorch_model.bin", "model.pt", "model.pth")
# Wrappers that training scripts put around the weights (OpenCLIP's {"epoch", "state_dict", ...}).
WRAPPER_KEYS = ("state_dict", "model", "module")
# Prefixes DistributedDataParallel / torch.compile add to every key.
KEY_PREFIXES = ("module.", "_orig_mod.")


def weights_file(path: Union[str, Path]) -> Path:
    """`path` itself, or the weights file inside the folder `path` (see WEIGHT_FILES)."""
    path = Path(path)
    if path.is_dir():
        for name in WEIGHT_FILES:
            if (path / name).exists():  # a FIFO or a link out there is refused when it is read, not passed over
                return check_inside(path / name, path, "weights", CheckpointError)
        raise FileNotFoundError(f"no weights in {path}: expected one of {', '.join(WEIGHT_FILES)}")
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint file at {path}")
    return path


def read_state_dict(path: Union[str, Path]) -> dict[str, torch.Tensor]:
    """{name: tensor} on the CPU from a safetensors or torch file (or a folder holding one)."""
    path = regular_file(weights_file(path), "weights", error=CheckpointError)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(path, device="cpu")
        except Exception as error:  # safetensors raises its own error types for a bad header
            raise CheckpointError(f"{path} is not a readable safetensors file ({error})") from None
    if zipfile.is_zipfile(path) and any(name.endswith("constants.pkl") for name in zipfile.ZipFile(path).namelist()):
        raise CheckpointError(f"{path} is a TorchScript archive (OpenAI's original release format), which topoclip "
                              f"does not load because it carries code; use OpenCLIP's safetensors copy of the same "
                              f"weights (e.g. open_clip_model.safetensors from hf-hub:timm/vit_base_patch16_clip_224.openai)")
    try:
        with torch_archive(path, "weights", error=CheckpointError) as file:
            loaded = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # torch's message ends with the reason ("unsupported GLOBAL posix.system", "Unsupported operand …")
        # and a pointer to its documentation.
        lines = [line.strip() for line in str(error).splitlines() if line.strip() and "documentation" not in line]
        reason = lines[-1] if lines else "unknown"
        raise CheckpointError(f"refused to load {path}: torch.load(weights_only=True) accepts tensors and plain "
                              f"containers only, and this file holds something else ({reason[:160]}); topoclip never "
                              f"runs code from a checkpoint. If you trust the file, re-save its state_dict() as "
                              f"safetensors") from None
    except (RuntimeError, EOFError, OSError) as error:
        raise CheckpointError(f"{path} is not a readable PyTorch checkpoint ({str(error).splitlines()[0][:200]})") from None
    return _tensors(loaded, path)


def _tensors(loaded, path: Path) -> dict[str, torch.Tensor]:
    """The flat {name: tensor} inside what torch.load returned (wrappers and prefixes removed)."""
    while isinstance(loaded, dict):
        wrapper = next((key for key in WRAPPER_KEYS if isinstance(loaded.get(key), dict)), None)
        if wrapper is None:
            break
        loaded = loaded[wrapper]
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{path} holds a {type(loaded).__name__}, not a state dict of named tensors")
    state = {}
    for name, value in loaded.items():
        if not isinstance(value, torch.Tensor):
            continue  # bookkeeping next to the weights (epoch numbers, names)
        for prefix in KEY_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
        state[name] = value
    if not state:
        raise CheckpointError(f"{path} holds no tensors")
    return state


def source_name(source, default: str) -> str:
    """A run name for an import: the file's stem, or `default` for an in-memory state dict."""
    return Path(source).stem if isinstance(source, (str, Path)) else default


def check_destination(destination: Union[str, Path]) -> Path:
    """A folder to write a checkpoint into: new or empty (an existing folder is never replaced)."""
    destination = Path(destination)
    if destination.is_symlink():  # replacing the link's folder would write where the link points
        raise ConfigError(f"{destination} is a symbolic link; give the folder itself, or a new folder")
    if destination.exists() and (not destination.is_dir() or not is_empty(destination)):
        raise ConfigError(f"{destination} already exists and is not an empty folder; choose a new folder")
    return destination


@contextmanager
def new_folder(destination: Union[str, Path], what: str) -> Iterator[Path]:
    """A scratch sibling of `destination` (checked new or empty: `check_destination`) to write `what` into, renamed
    onto `destination` when the block ends and removed on any error: the destination gets every file or none. A
    full disk is a DiskFullError that says nothing was written."""
    destination = check_destination(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    with scratch_folder(destination, f"writing {what} {destination}") as scratch:
        yield scratch
