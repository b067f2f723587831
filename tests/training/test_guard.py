"""The step's guards (training.guard) on their own, including the GPU's deferred checks, on a CPU."""
import pytest
import torch

from topoclip.config import load_config
from topoclip.core.errors import NonFiniteError
from topoclip.run.training.guard import MAX_SKIPPED_STEPS, StepGuard
from topoclip.io.run_folder import RunFolder

NAN, ONE = torch.tensor(float("nan")), torch.tensor(1.0)


def guard(tmp_path, deferred: bool) -> StepGuard:
    made = StepGuard(torch.device("cpu"), RunFolder(tmp_path), load_config("tiny"), main=True)
    made.deferred = deferred  # as on a GPU: the host reads only at the steps that read values anyway
    return made


def test_on_a_cpu_every_step_is_checked(tmp_path):
    assert guard(tmp_path, deferred=False).must_check(reads_due=False)


def test_deferred_checks_happen_when_values_are_read_or_a_checkpoint_waits(tmp_path):
    watch = guard(tmp_path, deferred=True)
    assert not watch.must_check(reads_due=False) and watch.must_check(reads_due=True)
    watch.hold({"step": 4})
    assert watch.must_check(reads_due=False)


def test_a_held_checkpoint_is_written_only_after_a_finite_loss(tmp_path):
    watch = guard(tmp_path, deferred=False)
    watch.hold({"step": 4})
    assert watch.vouched(finite=False) is None and watch.pending is None  # dropped: its weights gave NaN
    watch.hold({"step": 5})
    assert watch.vouched(finite=True) == {"step": 5}


def test_steps_skipped_on_the_device_are_reported_at_the_next_check(tmp_path, capsys):
    watch, model = guard(tmp_path, deferred=True), torch.nn.Linear(2, 2)
    for loss in (NAN, NAN, ONE):
        watch.record(loss)
    assert watch.check(model, ONE, step=3) == (1.0, True)
    assert "2 step(s) before step 3 had a non-finite loss and were skipped" in capsys.readouterr().err
    assert watch.skipped == 2


def test_too_many_non_finite_losses_in_a_row_stop_the_run_even_if_seen_late(tmp_path):
    watch, model = guard(tmp_path, deferred=True), torch.nn.Linear(2, 2)
    for _ in range(MAX_SKIPPED_STEPS):
        watch.record(NAN)
    watch.record(ONE)  # the run of NaNs ended before the host looked: still stopped
    with pytest.raises(NonFiniteError, match=f"non-finite for {MAX_SKIPPED_STEPS} steps in a row"):
        watch.check(model, ONE, step=MAX_SKIPPED_STEPS + 1)


def test_weights_made_non_finite_by_a_deferred_update_stop_the_run(tmp_path):
    watch, model = guard(tmp_path, deferred=True), torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    watch.record(ONE)
    with pytest.raises(NonFiniteError, match="step 7: an update since the last check made some weights inf/NaN.*"
                                             "no checkpoint was written; lower train.lr"):
        watch.check(model, ONE, step=7)
