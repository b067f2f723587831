"""The step's guards: no non-finite weight is ever trained on, checkpointed or evaluated.

A step whose loss is inf/NaN is skipped (no update; its batch and its learning-rate step still
pass), as mixed-precision trainers skip overflowing steps; MAX_SKIPPED_STEPS such steps in a row
stop the run. Weights are checked after every update: weights that became inf/NaN stop the run at
once. Either stop names the step, the last good checkpoint and what to change (a lower train.lr,
most often).

A checkpoint due at step N is held (`hold`) and written during step N + 1, once N's weights have
given a finite loss, before N + 1's update (so weights and optimiser state are still N's). The last
step has no next step to vouch for it: `vouch_last` checks its weights' loss on its own batch.

On a GPU the host reads device values only at the steps that need them (`must_check`: logging,
evaluation, checkpoints, the last step), so it queues the next step meanwhile; in between, a
non-finite loss skips the update on the device (fused AdamW) and is counted there (SkippedSteps).
On a CPU a read costs nothing: every step is checked.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import torch
from tqdm.auto import tqdm

from topoclip.config import Config
from topoclip.core.distributed import is_sharded, local_part
from topoclip.core.errors import NonFiniteError
from topoclip.io.run_folder import RunFolder
from topoclip.run.training.step import nonfinite_anywhere

# Steps with a non-finite loss skipped in a row before the run stops.
MAX_SKIPPED_STEPS = 5


class SkippedSteps:
    """Steps skipped for a non-finite loss, counted on the device; the host reads the counts only when it checks.

    `record` every step; `read` returns (in a row now, the longest run in a row since the last read,
    total so far) as ints — the one host read, at the steps that read values anyway (logging,
    checkpoints) on a GPU, or every step on a CPU, where a read costs nothing.
    """

    def __init__(self, device: torch.device):
        self.in_row = torch.zeros((), device=device)
        self.longest = torch.zeros((), device=device)
        self.total = torch.zeros((), device=device)

    def record(self, nonfinite: torch.Tensor) -> None:
        """nonfinite: 0-d float, 1 = this step was skipped."""
        self.in_row = (self.in_row + 1) * nonfinite
        self.longest = torch.maximum(self.longest, self.in_row)
        self.total = self.total + nonfinite

    def read(self) -> tuple[int, int, int]:
        in_row, longest, total = torch.stack([self.in_row, self.longest, self.total]).tolist()
        self.longest = self.in_row.clone()
        return int(in_row), int(longest), int(total)


@dataclass
class Verdict:
    """The guards' verdict on one step's loss (`StepGuard.judge`).

    nonfinite: 0-d flag on the device, 1 when the loss is non-finite on any rank (the update is then skipped);
    checked: whether the host read the loss this step (on a GPU only when values are read anyway); loss and
    finite: the loss and whether it is finite, when checked; vouched: the checkpoint held at the last step, now
    safe to write (its weights gave a finite loss), or None.
    """

    nonfinite: torch.Tensor
    checked: bool
    loss: float = float("nan")
    finite: bool = True
    vouched: Optional[dict] = None


class StepGuard:
    """The non-finite guards of one run. Each step the loop asks for one verdict, `judge(model, loss, step,
    reads_due)`, and after a checked update calls `check_update(model, step)`; a checkpoint due is `hold`-ed until
    the next step vouches for its weights, the last one checked by `vouch_last`.

    Inside `judge`: `record(loss)` -> the skip flag for the optimiser; `must_check` -> whether the host reads now;
    `check(model, loss, step)` -> (loss as a float, finite) or a NonFiniteError; `vouched(finite)` -> the held
    checkpoint, now safe to write.
    """

    def __init__(self, device: torch.device, folder: RunFolder, config: Config, main: bool, skipped: int = 0):
        self.deferred = device.type == "cuda"
        self.skips = SkippedSteps(device)
        self.before, self.skipped = skipped, skipped  # a resumed run's count goes on from its checkpoint's
        self.pending: Optional[dict] = None
        self.folder, self.config, self.main = folder, config, main

    def judge(self, model: torch.nn.Module, loss: torch.Tensor, step: int, reads_due: bool) -> Verdict:
        """This step's verdict (see `Verdict`); a NonFiniteError when the run must stop."""
        nonfinite = self.record(loss)  # decided over all ranks: their gradients are averaged
        if not self.must_check(reads_due):
            return Verdict(nonfinite, checked=False)
        loss_value, finite = self.check(model, loss, step)
        return Verdict(nonfinite, True, loss_value, finite, self.vouched(finite))

    def record(self, loss: torch.Tensor) -> torch.Tensor:
        """0-d flag, 1 when this step's loss is non-finite on any rank (its update is then skipped)."""
        nonfinite = nonfinite_anywhere(loss)
        self.skips.record(nonfinite)
        return nonfinite

    def must_check(self, reads_due: bool) -> bool:
        """Whether the host checks this step: always on a CPU; on a GPU when values are read anyway
        (`reads_due`: logging, evaluation, checkpoint) or a held checkpoint waits for its voucher."""
        return not self.deferred or reads_due or self.pending is not None

    def check(self, model: torch.nn.Module, loss: torch.Tensor, step: int) -> tuple[float, bool]:
        """(the loss, whether it is finite); stops the run on weights made non-finite by a deferred update,
        or on MAX_SKIPPED_STEPS non-finite losses in a row."""
        if self.deferred and not parameters_finite(model):  # an update since the last check
            raise self.stop("an update since the last check made some weights inf/NaN", step)
        loss_value = float(loss)
        skipped_before = self.skipped
        in_row, longest_in_row, total = self.skips.read()
        self.skipped = self.before + total
        finite = in_row == 0
        unseen = self.skipped - skipped_before - (0 if finite else 1)  # skipped on the device since the last check
        if self.main and unseen > 0:
            tqdm.write(f"topoclip: {unseen} step(s) before step {step} had a non-finite loss and were skipped",
                       file=sys.stderr)
        if longest_in_row >= MAX_SKIPPED_STEPS:
            shown = "" if finite else f" ({loss_value})"
            raise self.stop(f"the loss was non-finite{shown} for {longest_in_row} steps in a row", step)
        if self.main and not finite:
            tqdm.write(f"topoclip: step {step}: the loss is {loss_value}; step skipped ({in_row} in a row; "
                       f"the run stops at {MAX_SKIPPED_STEPS})", file=sys.stderr)
        return loss_value, finite

    def hold(self, checkpoint: dict) -> None:
        """A checkpoint due now, written once the next step's loss vouches for these weights."""
        self.pending = checkpoint

    def vouched(self, finite: bool) -> Optional[dict]:
        """The held checkpoint when this step's loss (of its weights) is finite; dropped otherwise."""
        checkpoint, self.pending = self.pending, None
        return checkpoint if finite else None

    def check_update(self, model: torch.nn.Module, step: int) -> None:
        """Stops the run when the update made some weights non-finite (before any checkpoint holds them)."""
        if not parameters_finite(model):
            raise self.stop("the update made some weights inf/NaN", step)

    def vouch_last(self, loss: torch.Tensor, step: int) -> None:
        """The last update's weights, before they are saved: their loss on the last batch must be finite."""
        if bool(nonfinite_anywhere(loss)):
            raise self.stop("the last update made the loss non-finite", step)

    def stop(self, what: str, step: int) -> NonFiniteError:
        """The error that stops the run: the step, the last good checkpoint, what to change."""
        settings = self.config.train
        changes = f"lower train.lr (now {settings.lr:g})"
        if settings.precision != "fp32":
            changes += f", or use train.precision=fp32 (now {settings.precision})"
        changes += f", or lower model.temperature.max_scale (now {self.config.model.temperature.max_scale:g})"
        found = self.folder.step_checkpoints()
        if found:
            where = (f"nothing after {found[-1].name} was saved; the last good checkpoint is {found[-1]}; {changes}, "
                     f"then continue from it with `topoclip train --resume {self.folder.path} --set train.lr=...`")
        else:
            where = f"no checkpoint was written; {changes} and start a new run"
        return NonFiniteError(f"training stopped at step {step}: {what}; {where}")


def parameters_finite(model: torch.nn.Module) -> bool:
    """True when every parameter is finite (one device sync for all of them).

    Reads the sum of all weights: an inf or NaN anywhere makes it non-finite (NaN + x = NaN, inf - inf
    = NaN). It is 6x cheaper on CPU than isfinite per element; only weights summing past 3e38, broken
    anyway, would also count as non-finite.
    """
    with torch.no_grad():
        # A sharded model's parameters (FSDP) are summed shard by shard on each rank, then across ranks: every
        # rank gives the same answer.
        sums = torch.stack([local_part(p).sum(dtype=torch.float32) for p in model.parameters()]).sum()
        if is_sharded(model):
            torch.distributed.all_reduce(sums)
        return bool(torch.isfinite(sums))
