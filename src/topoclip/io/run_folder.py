"""A run folder: where each of its files lives (`RunFolder`), what state the run is in, and who owns it.

    RUN/config.json      the resolved config        RUN/checkpoints/step-NNNNNN/   weights, config, tokenizer,
    RUN/tokenizer.json   the run's vocabulary                                         training state
    RUN/metrics.jsonl    one JSON record per log    RUN/eval.json                  the final evaluation
    RUN/plots/*.png      loss, τ, lr, evaluation    RUN/.lock                      the owner (see below)
    RUN/lora-base/       a LoRA run's frozen base weights (topoclip.model.lora), from which a resume rebuilds

Who owns it: a fresh run starts only in an empty folder, one process at a time holds it.

The owner holds an advisory lock on ``RUN_DIR/.lock`` (flock(2)); the file names its pid and host.
The kernel drops the lock when its process ends, however it ends, so the lock file a `kill -9`'d
run leaves behind is taken over by the next run (with a note), while a second process started
beside a live one (a fresh run into the same `--out`, or a second `--resume`) stops with one line
naming the holder. A run that ends normally removes the file.

Files the trainer replaces in place (config.json) are written to a scratch sibling and renamed (see
`topoclip.core.atomic.scratch_name`), so a reader or a crash sees the old file or the new one, never half of one.
"""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Optional

from topoclip.io.checkpoint import CHECKPOINTS, checkpoint_step, step_checkpoints
from topoclip.core.door import list_folder
from topoclip.core.errors import RunFolderError
from topoclip.core.locks import LOCK, RunFolderLock, _lock, fcntl

CONFIG = "config.json"  # the run's resolved config (a model folder's is topoclip.io.checkpoint.MODEL_CONFIG)
TOKENIZER = "tokenizer.json"
METRICS = "metrics.jsonl"
EVALUATION = "eval.json"
PLOTS = "plots"
LORA_BASE = "lora-base"


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
    lora_base = property(lambda self: self.path / LORA_BASE)

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
    from topoclip.core.door import open_regular

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
# The numbers a record may carry, as the trainer logs them (topoclip.run.training.trainer.train_steps).
METRIC_NUMBERS = ("loss", "scale", "t", "lr", "grad_norm", "images_per_s", "skipped_steps", "curvature", "loss_scale",
                  "alpha_image", "alpha_text", "contrastive_loss", "entailment_loss")


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


def claim_run_folder(run_dir, resuming: bool) -> RunFolderLock:
    """Create (fresh run) or open (resume) `run_dir` and take its lock; RunFolderError when it cannot be used.

    A fresh run refuses a folder that holds anything but a stale lock file: it would mix two runs'
    metrics and checkpoints. Call on the process that writes (rank 0) only.
    """
    run_dir = Path(run_dir)
    # the folder comes from --out, or from OpenCLIP's --logs and --name: the fix names both
    fix = "make it writable" if resuming else "choose a writable --out (or --logs/--name)"
    try:
        if not resuming:
            run_dir.mkdir(parents=True, exist_ok=True)
        elif not run_dir.is_dir():
            raise RunFolderError(f"cannot resume {run_dir}: it is not a folder")
        lock = _lock(run_dir) if fcntl is not None else RunFolderLock(run_dir, None)
    except FileExistsError:
        raise RunFolderError(f"the run folder {run_dir} is a file, not a folder; choose another --out (or "
                             f"--logs/--name)") from None
    except OSError as error:  # permission denied, read-only file system, ...
        raise RunFolderError(f"cannot write to the run folder {run_dir} ({error.strerror or error}); {fix}") from None
    if not resuming:
        present = [entry.name for entry in list_folder(run_dir, "run folder", error=RunFolderError) if entry.name != LOCK]
        if present:
            lock.release()
            shown = ", ".join(present[:4]) + (", ..." if len(present) > 4 else "")
            raise RunFolderError(f"run folder {run_dir} is not empty ({shown}); continue that run with "
                                 f"`topoclip train --resume {run_dir}`, or start a new one with another --out (or "
                                 f"--logs/--name)")
    if lock.previous_owner:
        print(f"topoclip: note: took over the lock of {run_dir} left by process {lock.previous_owner.split()[0]}, "
              f"which ended without releasing it", file=sys.stderr)
    return lock
