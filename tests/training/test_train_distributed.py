"""`topoclip train` under torchrun: 2 gloo processes on CPU write one run folder, and `--resume` continues it.

One launch trains 2 steps, a second launch resumes the folder with train.steps=4. Because the loss is the
local loss against the batch gathered from all ranks, two ranks take exactly the optimiser steps of
one process on the global batch: τ and the gradient norm logged by rank 0 equal a one-process run's.
"""
import json
from pathlib import Path

import pytest

from topoclip.config import load_config
from topoclip.run.training.logger import read_metrics
from topoclip.run.training.trainer import train

from _launch import torchrun
from _tolerance import TINY, gamma, model_roundings

WORLD = 2
SETTINGS = ["train.threads=1", "train.num_workers=0", "train.batch_size=8", "train.log_every=1",
            "train.checkpoint_every=1", "train.keep_checkpoints=10", "train.warmup_steps=1",
            "data.scenes.train_size=256", "data.scenes.val_size=16", "data.scenes.test_size=16",
            "evaluate.size=16", 'evaluate.template_modes=["distance"]', "evaluate.captions_per_image=2"]


def step_records(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """(work folder, run folder, metrics after the first launch, stdout of both launches)."""
    work = tmp_path_factory.mktemp("ddp-train")
    run = work / "run"
    overrides = [part for setting in SETTINGS + ["train.steps=2"] for part in ("--set", setting)]
    first = torchrun(work, "--preset", "tiny", *overrides, "--out", str(run))
    after_first = read_metrics(run / "metrics.jsonl")
    checkpoints_first = sorted(p.name for p in (run / "checkpoints").iterdir())
    second = torchrun(work, "--resume", str(run), "--set", "train.steps=4")
    return work, run, after_first, checkpoints_first, first.stdout + second.stdout


@pytest.mark.slow
def test_two_ranks_write_one_run_folder_once(launches):
    work, run, after_first, checkpoints_first, _ = launches
    assert sorted(p.name for p in work.iterdir()) == ["run"]  # no second folder, no runs/ from rank 1
    for name in ("config.json", "tokenizer.json", "metrics.jsonl", "eval.json", "plots/loss.png"):
        assert (run / name).is_file(), name
    steps = [r["step"] for r in after_first if "loss" in r]
    assert steps == [1, 2]  # rank 0 alone logs: each step once
    assert sum(1 for r in after_first if r.get("final")) == 1
    assert checkpoints_first == ["step-000001", "step-000002"]
    records = json.loads((run / "eval.json").read_text())
    assert {r["task"] for r in records} == {"zeroshot_classification", "zeroshot_retrieval"}


def test_resume_continues_from_the_checkpoint(launches):
    _, run, after_first, _, output = launches
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]  # continued, no duplicates
    # Steps 1-2 are the first launch's lines, untouched; its final evaluation (step 2) was logged before
    # the checkpoint step it resumed from and stays; the resumed run adds one final record at step 4.
    assert [r for r in records if r["step"] <= 2] == after_first
    assert [r["step"] for r in records if r.get("final")] == [2, 4]
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 4
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step-00000{s}" for s in range(1, 5)]
    assert output.count("run folder:") == 4  # rank 0 alone prints it, at the start and the end of each launch


@pytest.mark.slow
def test_two_ranks_take_the_steps_of_one_process_on_the_global_batch(launches, tmp_path):
    _, run, _, _, _ = launches
    distributed = {r["step"]: r for r in step_records(run)}
    # The same two launches in one process: 2 steps, then resumed with train.steps=4 (the cosine schedule
    # of the first launch ends at step 2, so an uninterrupted 4-step run would not be comparable).
    single = train(load_config("tiny", SETTINGS + ["train.steps=2"]), out_dir=tmp_path / "single", progress=False)
    saved = json.loads((single / "config.json").read_text())
    train(load_config(values=saved, overrides=["train.steps=4"]), resume=single, progress=False)
    one = {r["step"]: r for r in step_records(single)}
    for step in range(1, 5):
        # The gradient after DDP's all-reduce is the one-process gradient of the mean loss: same clipped
        # norm, same update, so the same τ after every step (across the resume too).
        # Two fp32 orders of the same sums (halves + all-reduce): the gradient within 2·γ_n normwise
        # (tests/_tolerance.py), carried through ≤ 4 AdamW steps at lr 1e-3, whose update is the gradient's
        # sign to first order; τ moves by ≤ lr per step, so its relative difference stays ≤ 4·lr·2·γ_n.
        bound = 2 * gamma(model_roundings(TINY, 8))
        assert distributed[step]["grad_norm"] == pytest.approx(one[step]["grad_norm"], rel=step * bound), step
        assert distributed[step]["scale"] == pytest.approx(one[step]["scale"], rel=bound), step
        assert distributed[step]["lr"] == one[step]["lr"], step  # a float64 function of the step alone


@pytest.mark.slow
def test_two_ranks_log_the_entailment_loss_s_parts_of_the_global_batch(tmp_path):
    """MERU's two parts (and c, α) as rank 0 logs them under torchrun are the global batch's: the mean of the ranks'
    local parts, as the loss is, and one process's on the same global batch."""
    settings = SETTINGS + ["model.topology=lorentz", "train.entailment_weight=0.2", "train.steps=2"]
    torchrun(tmp_path, "--preset", "tiny", *[p for s in settings for p in ("--set", s)], "--out", str(tmp_path / "ddp"))
    single = train(load_config("tiny", settings), out_dir=tmp_path / "one", progress=False)
    distributed, one = ({r["step"]: r for r in step_records(run)} for run in (tmp_path / "ddp", single))
    # As the test above: two fp32 orders of the same sums (each part a mean over the rows of the global batch),
    # carried through one AdamW step by step 2; the ranks' mean is float64's, which adds nothing at this bound.
    bound = 2 * gamma(model_roundings(TINY, 8))
    for step in (1, 2):
        for key in ("loss", "contrastive_loss", "entailment_loss", "curvature", "alpha_image", "alpha_text"):
            assert distributed[step][key] == pytest.approx(one[step][key], rel=step * bound, abs=0), (step, key)
        record = distributed[step]  # each rank's loss is its fp32 contrastive + 0.2·entailment (two roundings)
        assert record["loss"] == pytest.approx(record["contrastive_loss"] + 0.2 * record["entailment_loss"],
                                               rel=bound, abs=0), step


def test_logged_sample_counts_cover_every_rank(launches):
    _, run, _, _, _ = launches
    for record in step_records(run):
        assert record["data"]["kept"] == 8 * record["step"]  # the global batch, not rank 0's 4


@pytest.mark.slow
def test_a_csv_stream_resumed_under_torchrun_continues_every_rank_exactly(tmp_path):
    """Issue #16 item 4 under torchrun: each rank reads its own share of the CSV (2 DataLoader workers each);
    a checkpoint stores both ranks' places, so a run killed after step 3 and resumed logs the same losses
    at steps 4-6 as the uninterrupted run (and the same data counts)."""
    import shutil

    from test_resume_stream import write_csv
    from test_train_user_data import scene_samples

    table = write_csv(tmp_path / "data", scene_samples(30))
    settings = [s for s in SETTINGS if not s.startswith(("train.num_workers", "train.batch_size"))] + [
        "data.source=csv", f"data.train_data={table}", "data.tokenizer=", "train.num_workers=2",
        "train.batch_size=8", "train.steps=6"]
    whole = tmp_path / "whole"
    torchrun(tmp_path, "--preset", "tiny", *[p for s in settings for p in ("--set", s)], "--out", str(whole))
    killed = tmp_path / "killed"  # the same folder as a kill after step 3's checkpoint leaves it
    shutil.copytree(whole, killed)
    for step in (4, 5, 6):
        shutil.rmtree(killed / "checkpoints" / f"step-{step:06d}")
    (killed / "eval.json").unlink()
    torchrun(tmp_path, "--resume", str(killed))
    expected, got = step_records(whole), step_records(killed)
    assert [r["step"] for r in got] == list(range(1, 7))
    assert [(r["loss"], r["data"]) for r in got] == [(r["loss"], r["data"]) for r in expected]


@pytest.mark.slow
def test_each_rank_trains_in_rank_0s_folder(tmp_path):
    """Before the fix, each rank kept the folder it was given: the default runs/NAME-TIMESTAMP holds the second each
    process started, so rank 1 could name a folder rank 0 never wrote."""
    work = tmp_path / "work"
    worker = Path(__file__).resolve().parents[1] / "_run_dir_worker.py"
    torchrun(tmp_path, str(work), *SETTINGS, "train.steps=1", script=worker)
    assert sorted(p.name for p in work.iterdir()) == ["rank0"]
    assert [Path(f"{work}.rank{rank}").read_text() for rank in range(WORLD)] == [str(work / "rank0")] * WORLD
