"""Run folders that cannot be corrupted (issue 9, items 1-4 and 6; issue 7, items 5-7).

A fresh run never reuses a folder; one process at a time holds one (a real `kill -9` leaves a lock the
next run takes over); a resume refuses what a checkpoint cannot continue before it writes anything; a
torn metrics line does not block a resume; inf/NaN never reach a checkpoint; a full disk says so.
Each test's docstring says how the main branch before this change failed.
"""
import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from topoclip.io.checkpoint import WEIGHTS, step_checkpoints
from topoclip.cli import main
from topoclip.config import ConfigError, load_config
from topoclip.core.errors import NonFiniteError
from topoclip.run.training import guard, trainer
from topoclip.io.run_folder import read_metrics
from topoclip.run.training.optim import cosine_with_warmup
from topoclip.core.locks import LOCK
from topoclip.io.run_folder import claim_run_folder
from topoclip.run.training.trainer import train

# A small, fast run: 32 px scenes, tiny towers, no DataLoader workers, small evaluation sets.
SMALL = ["train.num_workers=0", "train.log_every=1", "train.warmup_steps=1", "evaluate.size=48",
         'evaluate.template_modes=["distance"]', "data.scenes.train_size=2048", "data.scenes.val_size=64",
         "data.scenes.test_size=64"]


def cli(*settings: str) -> list[str]:
    """`--set` arguments of SMALL plus `settings`."""
    return [part for setting in SMALL + list(settings) for part in ("--set", setting)]


def snapshot(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `folder`: equal snapshots = nothing was written."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("topoclip: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4 (copy it before changing it)."""
    config = load_config("tiny", SMALL + ["train.steps=4", "train.checkpoint_every=2", "train.keep_checkpoints=5"])
    return train(config, out_dir=tmp_path_factory.mktemp("finished") / "run", progress=False)


def copy_run(run: Path, to: Path, killed_after: int = 0) -> Path:
    """A copy of `run`; with `killed_after`, as if killed right after that step's checkpoint."""
    import shutil

    shutil.copytree(run, to)
    if killed_after:
        for folder in step_checkpoints(to / "checkpoints"):
            if int(folder.name.split("-")[1]) > killed_after:
                shutil.rmtree(folder)
        (to / "eval.json").unlink()
    return to


# --------------------------------------------------------------------------- 1. one run per folder


@pytest.mark.slow
def test_a_fresh_run_refuses_a_folder_that_holds_a_run(finished_run, tmp_path, capsys):
    """main: `train --out r` into a finished run exited 0, erased its metrics and left its old checkpoints
    beside the new run's (two runs mixed in one folder)."""
    run = copy_run(finished_run, tmp_path / "run")
    before = snapshot(run)
    assert main(["train", "--preset", "tiny", "--quiet", *cli("train.steps=2"), "--out", str(run)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "not empty" in line and f"--resume {run}" in line and "--out" in line
    assert snapshot(run) == before


HOLD_LOCK = ("import sys, time\n"
             "from topoclip.io.run_folder import claim_run_folder\n"
             "claim_run_folder(sys.argv[1], resuming=sys.argv[2] == 'resume')\n"
             "print('locked', flush=True)\n"
             "time.sleep(300)\n")


def hold_lock(folder: Path, mode: str) -> subprocess.Popen:
    """Another process that holds `folder`'s lock until it is killed."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(folder), mode], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


@pytest.mark.slow
def test_a_second_process_is_refused_while_another_holds_the_folder(finished_run, tmp_path, capsys):
    """main: two trainings into one --out both exited 0 with interleaved metrics, and two concurrent
    `--resume r` crashed on a .tmp rename: nothing stopped a second process."""
    run = copy_run(finished_run, tmp_path / "run", killed_after=2)
    before = snapshot(run)
    holder = hold_lock(run, "resume")
    try:
        assert main(["train", "--resume", str(run), "--quiet"]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert f"in use by process {holder.pid}" in line and "another --out" in line
    finally:
        holder.kill()
        holder.wait()
    after = snapshot(run)
    after.pop(LOCK)  # the killed holder's stale lock
    assert after == before

    fresh = tmp_path / "fresh"
    holder = hold_lock(fresh, "fresh")
    try:
        assert main(["train", "--preset", "tiny", "--quiet", *cli("train.steps=2"), "--out", str(fresh)]) == 2
        assert f"in use by process {holder.pid}" in one_error_line(capsys.readouterr().err)
        assert sorted(p.name for p in fresh.iterdir()) == [LOCK]  # the second process wrote nothing
    finally:
        holder.kill()
        holder.wait()


def test_a_file_gone_between_listing_and_looking_is_not_a_special_file(tmp_path, monkeypatch):
    """A second process checking a folder in use saw the owner's scratch file listed, then renamed, and refused the
    folder for "special files" instead of saying who holds it: a vanished entry is neither a link nor special."""
    from topoclip.core.errors import RunFolderError
    from topoclip.core.locks import refuse_links

    (tmp_path / "metrics.jsonl").write_text("{}")
    listing = Path.iterdir
    monkeypatch.setattr(Path, "iterdir", lambda self: iter([*listing(self), self / ".gone.0123456789ab.partial"]))
    refuse_links(tmp_path, "run folder")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(RunFolderError, match=r"special files \(fifo\)"):
        refuse_links(tmp_path, "run folder")


@pytest.mark.slow
def test_the_lock_of_a_killed_run_is_taken_over(tmp_path, capsys):
    """A real training process killed with SIGKILL leaves its lock file; `--resume` takes it over, says so,
    and finishes the run. (main had no lock at all; see the test above.)"""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "topoclip", "train", "--preset", "tiny", "--quiet",
               *cli("train.steps=1000", "train.checkpoint_every=1", "train.threads=1"), "--out", str(run)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while not step_checkpoints(run / "checkpoints"):
            assert process.poll() is None, process.stderr.read().decode()
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.2)
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL
    assert (run / LOCK).read_text().split()[0] == str(process.pid)  # left behind by the killed run

    newest = int(step_checkpoints(run / "checkpoints")[-1].name.split("-")[1])
    code = main(["train", "--resume", str(run), "--quiet", "--set", f"train.steps={newest + 2}"])
    err = capsys.readouterr().err
    assert code == 0, err  # (once seen failing under a loaded machine: the error line says why)
    assert f"took over the lock of {run} left by process {process.pid}" in err
    assert not (run / LOCK).exists() and (run / "eval.json").is_file()
    logged = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert logged == list(range(1, newest + 3))  # each step once: the killed run's steps after its checkpoint are gone


# --------------------------------------------------------------------------- 2. a resume cannot corrupt the run


@pytest.mark.slow
def test_a_resume_refuses_shape_changes_before_writing_anything(finished_run, tmp_path, capsys):
    """main: `--resume r --set model.class_tokens=8` failed with a traceback but had already rewritten
    config.json, so a later plain `--resume r` failed too."""
    run = copy_run(finished_run, tmp_path / "run", killed_after=2)
    before = snapshot(run)
    for change in ["model.class_tokens=8", "model.vision.width=96", "data.scenes.noise=0.5", "train.batch_size=8"]:
        assert main(["train", "--resume", str(run), "--set", change]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert f"cannot change {change.split('=')[0]}" in line
        assert "train.steps" in line and "train.lr" in line and "evaluate.*" in line  # what a resume may change
        assert snapshot(run) == before
    with pytest.raises(ConfigError, match="model.class_tokens"):  # the library refuses as the CLI does
        train(load_config("tiny", SMALL + ["train.steps=4", "train.checkpoint_every=2", "model.class_tokens=8"]),
              resume=run)
    assert snapshot(run) == before
    assert main(["train", "--resume", str(run), "--quiet"]) == 0  # the run is intact
    assert (run / "eval.json").is_file()


def test_preset_with_resume_is_refused(finished_run, tmp_path, capsys):
    """main: `--resume r --preset cpu-sphere` ignored the preset without a word and exited 0."""
    run = copy_run(finished_run, tmp_path / "run", killed_after=2)
    before = snapshot(run)
    assert main(["train", "--resume", str(run), "--preset", "cpu-sphere"]) == 2
    assert "--preset cannot be combined with --resume" in one_error_line(capsys.readouterr().err)
    assert snapshot(run) == before


@pytest.mark.slow
def test_a_resume_trains_with_the_changes_it_allows(finished_run, tmp_path):
    """main: `--resume r --set train.lr=X` was accepted but the optimizer and scheduler state restored the
    old learning rate, so the new one never applied."""
    run = copy_run(finished_run, tmp_path / "run", killed_after=2)
    lr = 3e-3
    assert main(["train", "--resume", str(run), "--quiet", "--set", "train.steps=6", "--set", f"train.lr={lr}"]) == 0
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["steps"] == 6 and config["train"]["lr"] == lr
    logged = {r["step"]: r["lr"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}
    for step in (3, 4, 5):  # the lr logged after step s is the schedule's value at s
        assert logged[step] == pytest.approx(lr * cosine_with_warmup(step, 1, 6), rel=1e-9)


def test_resuming_a_finished_run_changes_nothing(finished_run, tmp_path, capsys):
    """main: `--resume` of a finished run evaluated it again, rewrote the plots and appended a second
    "final" record to metrics.jsonl."""
    run = copy_run(finished_run, tmp_path / "run")
    before = snapshot(run)
    assert main(["train", "--resume", str(run)]) == 0
    out = capsys.readouterr().out
    assert "is complete" in out and "--set train.steps=N" in out
    assert snapshot(run) == before


def test_a_later_srun_task_resuming_a_finished_run_leaves_it_to_task_0(finished_run, tmp_path, capsys, monkeypatch):
    """Before the process group exists only the launcher's variables say which process this is: srun sets
    SLURM_PROCID, not RANK, and task 1 took task 0's part (the folder's lock, the note) as well."""
    run = copy_run(finished_run, tmp_path / "run")
    before = snapshot(run)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", "1")
    assert main(["train", "--resume", str(run)]) == 0
    assert "is complete" not in capsys.readouterr().out and snapshot(run) == before
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert main(["train", "--resume", str(run)]) == 0
    assert "is complete" in capsys.readouterr().out and snapshot(run) == before


def test_print_config_prints_and_writes_nothing(finished_run, tmp_path, capsys):
    """main had no way to see the resolved config without training."""
    out_dir = tmp_path / "new"
    assert main(["train", "--preset", "tiny", "--set", "train.steps=7", "--print-config", "--out", str(out_dir)]) == 0
    assert json.loads(capsys.readouterr().out)["train"]["steps"] == 7
    assert not out_dir.exists()
    run = copy_run(finished_run, tmp_path / "run")
    before = snapshot(run)
    assert main(["train", "--resume", str(run), "--set", "train.steps=9", "--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["train"]["steps"] == 9 and printed["model"]["class_tokens"] == 4
    assert snapshot(run) == before


@pytest.mark.slow
def test_the_run_folder_is_printed_first(tmp_path, capsys):
    """main printed where the outputs go only at the end, after the (silent when piped) final evaluation."""
    run = train(load_config("tiny", SMALL + ["train.steps=1"]), out_dir=tmp_path / "run", progress=False)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"run folder: {run.resolve()}"
    started = next(i for i, line in enumerate(out) if line.startswith("evaluating on "))
    assert "10 sets" in out[started] and started < next(i for i, line in enumerate(out) if line.startswith("dataset"))


# --------------------------------------------------------------------------- 3. torn metrics


@pytest.mark.slow
def test_a_torn_metrics_line_does_not_block_a_resume(finished_run, tmp_path):
    """main: a half-written last line of metrics.jsonl (a kill or a full disk mid-write) made the resume
    fail in json.loads, so the run could not be continued."""
    run = copy_run(finished_run, tmp_path / "run", killed_after=2)
    with (run / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 3, "loss": 4.1, "sca')  # torn: no end, no newline
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4]  # readers skip it
    with pytest.warns(UserWarning, match="last line is incomplete"):
        train(None, resume=run, progress=False)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line is whole again
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]  # each step once, after the cut to step 2
    assert [r.get("final") for r in records].count(True) == 1


# --------------------------------------------------------------------------- 4. non-finite values


def all_checkpoints_finite(run: Path) -> bool:
    return all(torch.isfinite(tensor).all() for folder in step_checkpoints(run / "checkpoints")
               for tensor in load_file(folder / WEIGHTS).values())


def test_a_diverging_run_stops_in_one_line_without_saving_bad_weights(tmp_path, capsys):
    """main: with lr=1e30 the step-1 update gave weights whose next loss is NaN; the run ended in a
    FloatingPointError traceback, after checkpointing those weights (which --resume would reload).
    train.lr is now bounded (≤ 10), so the loss is made non-finite by τ = exp(101), past fp32's range."""
    run = tmp_path / "run"
    settings = cli("train.steps=20", "model.temperature.max_scale=1e44", "model.temperature.init=101",
                   "train.checkpoint_every=1")
    assert main(["train", "--preset", "tiny", "--quiet", *settings, "--out", str(run)]) == 2
    err = capsys.readouterr().err
    line = err.splitlines()[-1]
    assert line.startswith("topoclip: error: training stopped at step ")
    assert "non-finite" in line and "lower train.lr (now 0.001)" in line and "no checkpoint was written" in line
    assert err.count("step skipped") == guard.MAX_SKIPPED_STEPS - 1  # the policy: skip, then stop
    assert not step_checkpoints(run / "checkpoints")  # the only weights written would have given NaN


def test_weights_that_become_non_finite_stop_the_run_before_a_checkpoint(tmp_path, monkeypatch):
    """main: parameters were never checked; NaN weights from an update were checkpointed (64/64 tensors
    non-finite with lr=Infinity) and reloaded by --resume."""
    real_step, calls = trainer.optimizer_step, []

    def poisoned_step(model, *args, **kwargs):
        norm = real_step(model, *args, **kwargs)
        calls.append(1)
        if len(calls) == 3:
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))
        return norm

    monkeypatch.setattr(trainer, "optimizer_step", poisoned_step)
    config = load_config("tiny", SMALL + ["train.steps=6", "train.checkpoint_every=1", "train.keep_checkpoints=9"])
    with pytest.raises(NonFiniteError, match=r"step 3: the update made some weights inf/NaN.*step-000002"):
        train(config, out_dir=tmp_path / "run", progress=False)
    assert [p.name for p in step_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-000001", "step-000002"]
    assert all_checkpoints_finite(tmp_path / "run")


def test_a_resumed_run_counts_its_skipped_steps_on_from_its_checkpoint(tmp_path, monkeypatch):
    """From the review of #61's stability table: the count of steps skipped for a non-finite loss started at 0 again
    on every resume (it was not in the checkpoint), so a run killed and resumed under-reported them."""
    import shutil

    real, calls = trainer.forward_backward_loss, []

    def nan_at_the_second_step(*args, **kwargs):
        calls.append(1)
        loss = real(*args, **kwargs)
        return loss * float("nan") if len(calls) == 2 else loss

    monkeypatch.setattr(trainer, "forward_backward_loss", nan_at_the_second_step)
    config = load_config("tiny", SMALL + ["train.steps=4", "train.checkpoint_every=3", "train.keep_checkpoints=9"])
    run = train(config, out_dir=tmp_path / "run", progress=False)
    state = torch.load(run / "checkpoints" / "step-000003" / "training_state.pt", weights_only=True)
    assert state["skipped"] == 1
    # killed after step 3's checkpoint: resumed, step 4 trains again (finite) and the count goes on from 1
    shutil.rmtree(run / "checkpoints" / "step-000004")
    (run / "eval.json").unlink()
    train(None, resume=run, progress=False)
    logged = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert [(r["step"], r.get("skipped_steps", 0)) for r in logged] == [(1, 0), (2, 1), (3, 1), (4, 1)]


# --------------------------------------------------------------------------- 6. a full disk


@pytest.mark.slow
def test_a_full_disk_while_checkpointing_says_so_and_keeps_the_previous_checkpoint(finished_run, tmp_path, monkeypatch,
                                                                                    capsys):
    """main: a full disk during torch.save surfaced as `RuntimeError: [enforce fail at inline_container.cc:672]
    . unexpected pos` (here: an OSError traceback), with no word of space or of what was intact."""
    real_save = torch.save

    def full_disk_at_step_4(state, target, *args, **kwargs):
        if isinstance(state, dict) and state.get("step") == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(state, target, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk_at_step_4)
    run = tmp_path / "run"
    settings = cli("train.steps=4", "train.checkpoint_every=2", "train.keep_checkpoints=1")
    assert main(["train", "--preset", "tiny", "--quiet", *settings, "--out", str(run)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"no space left on {run / 'checkpoints'} while writing checkpoint step 4" in line
    assert "the previous checkpoint step 2" in line and "is intact" in line and "--resume" in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]  # no half-written step 4
    monkeypatch.setattr(torch, "save", real_save)  # space freed
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    assert [p.name for p in step_checkpoints(run / "checkpoints")] == ["step-000004"]


# --------------------------------------------------------------------------- the lock itself


def test_the_lock_is_released_and_a_fresh_folder_may_hold_only_a_stale_lock(tmp_path):
    folder = tmp_path / "run"
    with claim_run_folder(folder, resuming=False) as lock:
        assert (folder / LOCK).read_text().split()[0] == str(os.getpid())
        assert lock.previous_owner is None
    assert not (folder / LOCK).exists()
    (folder / LOCK).write_text("999999 elsewhere\n")  # a stale lock, its process long gone
    with claim_run_folder(folder, resuming=False) as lock:
        assert lock.previous_owner == "999999 elsewhere"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reopens the unlinked lock file through /proc")
def test_a_failed_run_removes_its_empty_folder_while_it_still_holds_the_lock(tmp_path):
    """The folder is removed after the lock file is gone and before the lock is let go: a second process that claims
    the folder in that instant either finds it gone or has made its own lock file there, so the removal fails and
    its folder stays (rmdir removes only an empty folder)."""
    import fcntl

    from topoclip.io.run_folder import claim_run_folder

    run = tmp_path / "run"
    run.mkdir()
    lock = claim_run_folder(run, resuming=False)
    held = lock.descriptor
    seen = {}

    def during():
        seen["lock file"] = (run / LOCK).exists()
        other = os.open(f"/proc/self/fd/{held}", os.O_RDONLY)  # the unlinked lock file, another open file
        try:  # its lock is still this process's: a flock through the other open file fails
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            seen["still held"] = False
        except OSError:
            seen["still held"] = True
        finally:
            os.close(other)
        run.rmdir()

    lock.release(before_unlocking=during)
    assert seen == {"lock file": False, "still held": True} and not run.exists()
