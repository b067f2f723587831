"""Who owns a folder: an advisory lock (flock(2)) on FOLDER/.lock held by the one process that writes the folder (a
run folder, an ablation, a shard or embedding folder), and the check that nothing in it is a link or special file
through which a write would land elsewhere. See topoclip.io.run_folder for a run folder's use of it.

The lock file names its holder's pid and host. The kernel drops the lock when its process ends, however it ends,
so the lock file a `kill -9`'d process leaves behind is taken over by the next (with a note), while a second
process started beside a live one stops with one line naming the holder. A holder that ends normally removes
the file.
"""
from __future__ import annotations

import errno
import os
import socket
import stat
import sys
from pathlib import Path
from typing import Callable, Optional

from topoclip.core.door import list_folder
from topoclip.core.errors import RunFolderError
from topoclip.core.workers import HELD_LOCKS

try:
    import fcntl
except ImportError:  # Windows: no flock; the run folder is then not locked
    fcntl = None

LOCK = ".lock"


class RunFolderLock:
    """This process's hold on a run folder; `release()` (or leaving the `with` block) gives it up.

    previous_owner: "PID HOST" of a process that held the lock and ended without releasing it (None
    when the lock file was new or released cleanly).
    """

    def __init__(self, run_dir: Path, descriptor: Optional[int], previous_owner: Optional[str] = None):
        self.run_dir = Path(run_dir)
        self.descriptor = descriptor
        self.previous_owner = previous_owner

    @property
    def path(self) -> Path:
        return self.run_dir / LOCK

    def release(self, before_unlocking: Optional[Callable[[], None]] = None) -> None:
        """Give the folder up; `before_unlocking` runs once the lock file is gone but the lock still held (a failed
        run removing the empty folder it made, which no other process can have claimed meanwhile)."""
        if self.descriptor is None:
            return
        # Unlink while still holding the lock, then close (which unlocks): a process that opened the
        # old file meanwhile sees that it was replaced and opens the path again (see `_lock`).
        try:
            if os.stat(self.path).st_ino == os.fstat(self.descriptor).st_ino:
                os.unlink(self.path)
        except OSError:
            pass
        try:
            if before_unlocking is not None:
                before_unlocking()
        finally:
            HELD_LOCKS.discard(self.descriptor)
            os.close(self.descriptor)
            self.descriptor = None

    def __enter__(self) -> "RunFolderLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# The folders inside a run or output folder that topoclip writes into (checked for links with the folder itself).
WRITTEN_FOLDERS = ("checkpoints", "plots", "tensorboard", "analysis", "img_emb", "text_emb")


def refuse_links(folder: Path, what: str) -> None:
    """RunFolderError when `folder` (or a folder topoclip writes inside it) holds a symbolic link, through which a
    write would land outside the folder the user named (a planted plots -> ~/ or metrics.jsonl -> ~/file), or a
    FIFO, socket or device, which would block a read or write forever."""
    for inside in (folder, *(folder / name for name in WRITTEN_FOLDERS)):
        if inside != folder and inside.is_symlink():  # the folder itself is the user's to place (a link to a disk)
            raise RunFolderError(f"{inside} is a symbolic link; topoclip writes only inside its {what}: replace the "
                                 f"link with a folder, or use another folder")
        if not inside.is_dir():
            continue
        foreign = [entry.name for entry in list_folder(inside, what, error=RunFolderError) if _link_or_special(Path(entry.path))]
        if foreign:
            raise RunFolderError(f"{inside} holds symbolic links or special files ({', '.join(foreign[:3])}); topoclip "
                                 f"writes only files inside its {what}: replace them with the files themselves, or use "
                                 f"another folder")


def _link_or_special(entry: Path) -> bool:
    """A symbolic link, FIFO, socket or device; False for a file or folder, and for an entry gone since it was listed
    (a scratch file the folder's running owner just renamed is neither a link nor special)."""
    try:
        mode = entry.lstat().st_mode
    except FileNotFoundError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def _owner(descriptor: int) -> str:
    os.lseek(descriptor, 0, os.SEEK_SET)
    return os.read(descriptor, 200).decode("utf-8", "replace").strip()


def _lock(run_dir: Path, what: str = "run folder", fix: str = "wait for that run to end or stop it, or train into "
          "another --out") -> RunFolderLock:
    """Take the folder's lock without waiting; RunFolderError naming the holder (and `fix`) when it is taken."""
    path = run_dir / LOCK
    refuse_links(run_dir, what)
    while True:
        try:  # never through a link: a planted .lock -> ~/file would be truncated and written
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as error:
            if error.errno != errno.ELOOP:
                raise
            raise RunFolderError(f"{path} is a symbolic link; topoclip writes only inside its {what}: remove it") from None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _owner(descriptor) or "another process"
            os.close(descriptor)
            pid, _, host = holder.partition(" ")
            who = f"process {pid}" + (f" on {host}" if host and host != socket.gethostname() else "")
            raise RunFolderError(f"{what} {run_dir} is in use by {who} (it holds {path}); {fix}") from None
        except OSError:  # a file system without flock (some network mounts): run unlocked
            print(f"topoclip: note: {run_dir} cannot be locked on this file system; make sure no other run uses it",
                  file=sys.stderr)
            os.close(descriptor)
            return RunFolderLock(run_dir, None)
        try:  # the holder may have released and unlinked the file between our open and flock
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(descriptor).st_ino:
            break
        os.close(descriptor)
    previous = _owner(descriptor) or None
    os.ftruncate(descriptor, 0)
    os.lseek(descriptor, 0, os.SEEK_SET)
    os.write(descriptor, f"{os.getpid()} {socket.gethostname()}\n".encode())
    HELD_LOCKS.add(descriptor)
    return RunFolderLock(run_dir, descriptor, previous)


def claim_folder(folder, what: str = "folder") -> RunFolderLock:
    """Create `folder` if needed and take its lock (an ablation's output: one owner at a time); RunFolderError
    naming the holder when another process has it."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if fcntl is None:
            return RunFolderLock(folder, None)
        return _lock(folder, what, "wait for that process to end or stop it, or use another --out")
    except FileExistsError:
        raise RunFolderError(f"{what} {folder} is a file, not a folder; choose another --out") from None
    except OSError as error:
        raise RunFolderError(f"cannot write to the {what} {folder} ({error.strerror or error}); choose another --out") from None
