"""User errors: problems the user can fix (a setting, a file, the disk, the device), told in one line.

Everything the library raises for such a problem is a :class:`UserError` (``ConfigError`` and
``DataQualityError`` among them). The `topoclip` command prints its message as one line and exits
with status 2; any other exception is a bug and keeps its traceback. The message says what went
wrong, where, and the fix.
"""
from __future__ import annotations

import errno
from pathlib import Path
from typing import Optional, Union

# errno values that mean "the disk (or the user's quota) is full".
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class UserError(Exception):
    """A problem the user can fix; its message is one line: what, where, and the fix."""


class ConfigError(UserError, ValueError):
    """A configuration that cannot work; the message names the field and the fix (topoclip.config exports it)."""


class RunFolderError(UserError):
    """A run folder that cannot be used: not empty for a fresh run, held by another process, unwritable."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be read or does not fit the model (wrong shapes, missing tensors)."""


class EvaluationSetError(UserError, ValueError):
    """An evaluation set that cannot be scored: empty, one class only, no readable images, malformed."""


class NonFiniteError(UserError, FloatingPointError):
    """Training produced inf/NaN values; the message names the step, the last good checkpoint and the fix."""


class DiskFullError(UserError):
    """No space left while writing `path`; what was written before is intact."""

    def __init__(self, message: str, path: Union[str, Path, None] = None):
        super().__init__(message)
        self.path = Path(path) if path is not None else None


# The longest file name most file systems take (ext4, XFS, APFS, NTFS: 255 bytes).
MAX_NAME_BYTES = 255


def file_name_problem(name) -> Optional[str]:
    """Why `name` cannot be one file name inside a folder the user chose, or None when it can.

    A name from a config, a flag or a file (a run name, a model name in a result file's name) must never leave
    its folder nor end in a traceback: one part (no "/" or backslash), not "." or "..", no NUL, valid UTF-8 (no
    lone surrogates), at most MAX_NAME_BYTES bytes.
    """
    if not isinstance(name, str) or not name:
        return "it is empty" if name == "" else f"it is a {type(name).__name__}, not text"
    if any(ord(char) < 32 or ord(char) == 127 for char in name):  # a NUL ends the name in C; a newline splits logs
        return "it holds a control character (a NUL, newline or tab)"
    if "/" in name or "\\" in name or name in (".", ".."):
        return "no '/' or backslash, not '.' or '..'"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "it is not valid text: it holds a lone surrogate"
    return f"it is {size} bytes, over the {MAX_NAME_BYTES} a file name may have" if size > MAX_NAME_BYTES else None


def check_file_name(name, what: str, fix: str) -> str:
    """`name` if it can be one file name (see `file_name_problem`), else UserError naming `what`, why and `fix`."""
    problem = file_name_problem(name)
    if problem:
        shown = repr(name)[:80] if isinstance(name, str) else type(name).__name__
        raise UserError(f"{what} {shown} must be a plain file name ({problem}); {fix}")
    return name


def is_disk_full(error: BaseException) -> bool:
    """True when `error` (or an exception it was raised from) says the disk or the quota is full.

    torch.save and safetensors wrap the OSError in their own exceptions; this reads the chain and
    the message ("No space left on device", "os error 28").
    """
    seen: set[int] = set()
    current: Optional[BaseException] = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_FULL_ERRNOS:
            return True
        text = str(current)
        if "No space left on device" in text or f"os error {errno.ENOSPC}" in text or "Disk quota exceeded" in text:
            return True
        current = current.__cause__ or current.__context__
    return False


def require_device(name: str, setting: str = "train.device") -> None:
    """Refuse a device this machine does not have (e.g. "cuda" without CUDA) with one clear line.

    name: "auto", "cpu", "cuda", "cuda:1", "mps", ...; `setting` is how the user named it.
    """
    import torch

    if name == "auto":
        return
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"{setting}={name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            built = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise UserError(f"{setting}={name!r} but CUDA is not available here ({built}); use {setting}=cpu "
                            f"(or auto, which picks CUDA when there is one)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"{setting}={name!r} but this machine has {torch.cuda.device_count()} CUDA device(s); "
                            f"use cuda:0 ... cuda:{torch.cuda.device_count() - 1}")
    if device.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise UserError(f"{setting}={name!r} but Apple MPS is not available here; use {setting}=cpu")


def resolve_device(name: str = "auto", setting: str = "device", local_rank: Optional[int] = None):
    """The torch.device a setting names: "auto" -> CUDA when available, else cpu; any other name checked by
    `require_device`. Under a launcher (`local_rank` given) a CUDA device without an index is this process's
    GPU, cuda:local_rank. The one device resolver: the trainer, the distributed set-up and the loaders use it."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        require_device(name, setting)
    device = torch.device(name)
    if device.type == "cuda" and device.index is None and local_rank is not None:
        device = torch.device("cuda", local_rank)
    return device
