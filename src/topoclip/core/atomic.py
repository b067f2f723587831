"""Files replaced in one step: a writer fills a scratch sibling and renames it into place, so a reader or a
crash sees the old file or the new one, never half of one.

Scratch siblings are named ".NAME.<12 hex digits>.partial" and created exclusively: the name is new, so a
writer never takes over, nor deletes, a file or folder of the user's (a user's "DST.tmp" stays untouched).
"""
from __future__ import annotations

import os
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from topoclip.core.errors import DiskFullError, is_disk_full

SCRATCH_SUFFIX = ".partial"


def scratch_name(path: Path) -> Path:
    """A fresh sibling name for `path`'s scratch copy (create it exclusively: open(..., "xb") or mkdir())."""
    path = Path(path)
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}{SCRATCH_SUFFIX}")


def write_atomic(path, write) -> None:
    """Replace `path` in one step: write(file) fills a new scratch sibling (binary, exclusive), then renamed."""
    path = Path(path)
    temporary = scratch_name(path)
    try:
        with open(temporary, "xb") as file:
            write(file)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def save_png_atomic(figure, path, **options) -> None:
    """Save a matplotlib figure as PNG to `path` in one step."""
    write_atomic(path, lambda file: figure.savefig(file, format="png", **options))


def write_text_atomic(path, text: str) -> None:
    """Replace `path` with `text` (UTF-8) in one step."""
    write_atomic(path, lambda file: file.write(text.encode("utf-8")))


@contextmanager
def scratch_folder(destination: Path, full_disk: str) -> Iterator[Path]:
    """A new scratch sibling of `destination` to fill; renamed onto `destination` when the block ends (an empty
    folder there is replaced; a folder with files makes the rename fail) and removed on any error, so the destination gets
    every file or none. A full disk is a DiskFullError: `full_disk` says what was being written, and that nothing was."""
    destination = Path(destination)
    scratch = scratch_name(destination)
    scratch.mkdir()
    try:
        yield scratch
        os.replace(scratch, destination)  # rename(2): an empty folder there is replaced, a full one refuses
    except BaseException as error:
        shutil.rmtree(scratch, ignore_errors=True)
        if is_disk_full(error):
            raise DiskFullError(f"no space left on {destination.parent} while {full_disk}; nothing was written: free "
                                f"some space and run the command again", destination) from None
        raise
