"""A run folder: where each of its files lives (`RunFolder`), what state the run is in, and who owns it.

    RUN/config.json      the resolved config        RUN/checkpoints/step-NNNNNN/   weights, config, tokenizer,
    RUN/tokenizer.json   the run's vocabulary                                         training state
    RUN/metrics.jsonl    one JSON record per log    RUN/eval.json                  the final evaluation
    RUN/plots/*.png      loss, τ, lr, evaluation    RUN/.lock                      the owner (see below)

Who owns it: a fresh run starts only in an empty folder, one process at a time holds it.

The owner holds an advisory lock on ``RUN_DIR/.lock`` (flock(2)); the file names its pid and host.
The kernel drops the lock when its process ends, however it ends, so the lock file a `kill -9`'d
run leaves behind is taken over by the next run (with a note), while a second process started
beside a live one (a fresh run into the same `--out`, or a second `--resume`) stops with one line
naming the holder. A run that ends normally removes the file.

Files the trainer replaces in place (config.json) are written to a scratch sibling and renamed (see
`topoclip.atomic.scratch_name`), so a reader or a crash sees the old file or the new one, never half of one.
"""
from __future__ import annotations

import errno
import io
import json
import os
import socket
import stat
import sys
from pathlib import Path
from typing import Optional

from topoclip.checkpoint import CHECKPOINTS, checkpoint_step, step_checkpoints
from topoclip.door import list_folder
from topoclip.errors import RunFolderError
from topoclip.workers import HELD_LOCKS

CONFIG = "config.json"  # the run's resolved config (a model folder's is topoclip.checkpoint.MODEL_CONFIG)
TOKENIZER = "tokenizer.json"
METRICS = "metrics.jsonl"
EVALUATION = "eval.json"
PLOTS = "plots"


class RunFolder:
    """The files of one training run: every reader and writer of a run folder names them through this."""

    def __init__(self, path) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    config = property(lambda self: self.path / CONFIG)
    tokenizer = property(lambda self: self.path / TOKENIZER)
    metrics = property(lambda self: self.path / METRICS)
    evaluation = property(lambda self: self.path / EVALUATION)
    checkpoints = property(lambda self: self.path / CHECKPOINTS)
    plots = property(lambda self: self.path / PLOTS)

    def step_checkpoints(self) -> list[Path]:
        """Its complete step checkpoints, oldest first."""
        return step_checkpoints(self.checkpoints, self.path)

    def newest_step(self) -> Optional[int]:
        """The step of its newest complete checkpoint, or None."""
        found = self.step_checkpoints()
        return checkpoint_step(found[-1]) if found else None

    def finished(self, steps: int) -> bool:
        """It trained all `steps` and was evaluated."""
        return self.newest_step() == steps and self.evaluation.is_file()

    def state(self, steps: int) -> str:
        """"finished" (see `finished`), "killed" (started: config.json, but not finished) or "new"."""
        if self.finished(steps):
            return "finished"
        return "killed" if self.config.is_file() else "new"

    @classmethod
    def of_checkpoint(cls, checkpoint) -> Optional["RunFolder"]:
        """The run folder a checkpoint folder belongs to (…/RUN/checkpoints/step-N), or None."""
        checkpoint = Path(checkpoint)
        if checkpoint.parent.name == CHECKPOINTS and (checkpoint.parent.parent / CONFIG).is_file():
            return cls(checkpoint.parent.parent)
        return None


def parse_metrics_lines(path: Path) -> tuple[list[dict], list[str]]:
    """(records, problems): the complete records of `path` (read through the door, a line at a time), and one note
    per line left out: not JSON, not a record of the kind the trainer writes (`is_record`), longer than any record
    (METRIC_LINE_CHARS), or the last line without its newline."""
    from topoclip.door import open_regular

    records, problems = [], []
    with open_regular(path, "metrics log", limit=None, error=RunFolderError) as binary:
        file = io.TextIOWrapper(binary, encoding="utf-8", errors="replace", newline="\n")
        number = 0
        while line := file.readline(METRIC_LINE_CHARS + 1):
            number += 1
            if not line.endswith("\n"):
                if len(line) <= METRIC_LINE_CHARS:  # the text after the last newline: a record still being written,
                    problems.append(f"the last line is incomplete ({len(line)} characters, no newline: {line[:40]!r})")
                    break  # or torn by a kill / full disk
                while (rest := file.readline(METRIC_LINE_CHARS)) and not rest.endswith("\n"):
                    pass  # a line no record has: passed over in bounded pieces
                problems.append(f"line {number} is over {METRIC_LINE_CHARS:,} characters")
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):  # not JSON, nested too deeply, an integer of 4,300+ digits
                problems.append(f"line {number} is not JSON ({line[:40]!r})")
                continue
            if is_record(record):
                records.append(record)
            else:
                problems.append(f"line {number} is not a metrics record")
    return records, problems


# The longest line of a metrics log: a record with every evaluation metric of a dozen sets is ~3 KB.
METRIC_LINE_CHARS = 1 << 16
# The numbers a record may carry, as the trainer logs them (topoclip.training.trainer.train_steps).
METRIC_NUMBERS = ("loss", "scale", "t", "lr", "grad_norm", "images_per_s", "skipped_steps")


def is_record(record) -> bool:
    """Whether `record` has the form the trainer logs: an object with a whole-number step; each of METRIC_NUMBERS it
    has a number; its evaluation ("eval") an object of numbers. A line edited into another shape is left out, so
    every reader (the plots, τ's curve, an ablation's report) can take the numbers as numbers."""
    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    if not isinstance(record, dict) or type(record.get("step")) is not int or record["step"] < 0:
        return False
    if not all(number(record[key]) for key in METRIC_NUMBERS if key in record):
        return False
    evaluation = record.get("eval")
    return evaluation is None or (isinstance(evaluation, dict) and all(map(number, evaluation.values())))


def read_metrics(path: Path) -> list[dict]:
    """The complete records of a metrics.jsonl, in order ([] when there is none yet).

    A torn or unreadable line (a run killed mid-write) is left out rather than failing the reader.
    """
    path = Path(path)
    if not path.is_file():
        return []
    return parse_metrics_lines(path)[0]


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

    def release(self) -> None:
        if self.descriptor is None:
            return
        # Unlink while still holding the lock, then close (which unlocks): a process that opened the
        # old file meanwhile sees that it was replaced and opens the path again (see `_lock`).
        try:
            if os.stat(self.path).st_ino == os.fstat(self.descriptor).st_ino:
                os.unlink(self.path)
        except OSError:
            pass
        HELD_LOCKS.discard(self.descriptor)
        os.close(self.descriptor)
        self.descriptor = None

    def __enter__(self) -> "RunFolderLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# The folders inside a run or output folder that topoclip writes into (checked for links with the folder itself).
WRITTEN_FOLDERS = (CHECKPOINTS, PLOTS, "tensorboard", "analysis", "img_emb", "text_emb")


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


def claim_run_folder(run_dir, resuming: bool) -> RunFolderLock:
    """Create (fresh run) or open (resume) `run_dir` and take its lock; RunFolderError when it cannot be used.

    A fresh run refuses a folder that holds anything but a stale lock file: it would mix two runs'
    metrics and checkpoints. Call on the process that writes (rank 0) only.
    """
    run_dir = Path(run_dir)
    fix = "make it writable" if resuming else "choose a writable --out"
    try:
        if not resuming:
            run_dir.mkdir(parents=True, exist_ok=True)
        elif not run_dir.is_dir():
            raise RunFolderError(f"cannot resume {run_dir}: it is not a folder")
        lock = _lock(run_dir) if fcntl is not None else RunFolderLock(run_dir, None)
    except FileExistsError:
        raise RunFolderError(f"--out {run_dir} is a file, not a folder; choose another --out") from None
    except OSError as error:  # permission denied, read-only file system, ...
        raise RunFolderError(f"cannot write to the run folder {run_dir} ({error.strerror or error}); {fix}") from None
    if not resuming:
        present = [entry.name for entry in list_folder(run_dir, "run folder", error=RunFolderError) if entry.name != LOCK]
        if present:
            lock.release()
            shown = ", ".join(present[:4]) + (", ..." if len(present) > 4 else "")
            raise RunFolderError(f"run folder {run_dir} is not empty ({shown}); continue that run with "
                                 f"`topoclip train --resume {run_dir}`, or start a new one with another --out")
    if lock.previous_owner:
        print(f"topoclip: note: took over the lock of {run_dir} left by process {lock.previous_owner.split()[0]}, "
              f"which ended without releasing it", file=sys.stderr)
    return lock


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

