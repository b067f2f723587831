"""`topoclip train` with train.parallelism=fsdp: the model sharded over 2 gloo processes (FSDP2) takes the steps of
one unsharded process on the global batch, and its checkpoints resume on another number of processes (2 → 1 and
1 → 2), under LiT locking and gradient checkpointing. The loss and gradients themselves are compared with a float64
reference in tests/training/test_distributed.py (the fsdp launch).
"""
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from topoclip.io.checkpoint import load_checkpoint
from topoclip.config import load_config
from topoclip.model.clip import CLIP
from topoclip.run.training.trainer import train

from _launch import LAUNCH_TIMEOUT_S, launch_env, torchrun
from _tolerance import TINY, gamma, model_roundings
from test_train_distributed import SETTINGS, step_records

FSDP = SETTINGS + ["train.parallelism=fsdp", "train.lock_image=true", "train.lock_image_unlocked_groups=1",
                   "train.gradient_checkpointing=true"]


# Hang guards, not speed targets: an eager tiny run takes seconds (LAUNCH_TIMEOUT_S, the launches' guard); a compiled
# one spends 30-60 s in inductor alone on two cores and once ran past 120 s beside a sweep on both, so a slow runner
# gets room before a hang is called.
COMPILED_TIMEOUT_S = 600


def one_process(cwd, *arguments: str, timeout: float = LAUNCH_TIMEOUT_S) -> None:
    """`topoclip train` in one process, without a launcher (FSDP makes its own group of one)."""
    done = subprocess.run([sys.executable, "-m", "topoclip", "train", *arguments, "--quiet"], cwd=cwd,
                          env=launch_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]


def flags(settings: list[str]) -> list[str]:
    return [part for setting in settings for part in ("--set", setting)]


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory):
    """The same two launches (2 steps, then resumed to 4) in one process without FSDP: the reference."""
    folder = tmp_path_factory.mktemp("one")
    reference = [s for s in FSDP if s != "train.parallelism=fsdp"]
    run = train(load_config("tiny", reference + ["train.steps=2"]), out_dir=folder / "run", progress=False)
    saved = json.loads((run / "config.json").read_text())
    train(load_config(values=saved, overrides=["train.steps=4"]), resume=run, progress=False)
    return {r["step"]: r for r in step_records(run)}


def assert_same_steps(run, unsharded) -> None:
    # As tests/training/test_train_distributed.py: two fp32 orders of the same sums, carried through ≤ 4 AdamW
    # steps whose update is the gradient's sign to first order (the derivation is written there).
    bound = 2 * gamma(model_roundings(TINY, 8))
    records = {r["step"]: r for r in step_records(run)}
    assert sorted(records) == [1, 2, 3, 4]
    for step, expected in unsharded.items():
        # The loss of step s is computed from the weights after s − 1 such updates: the same growth of the bound.
        assert records[step]["loss"] == pytest.approx(expected["loss"], rel=step * bound), step
        assert records[step]["grad_norm"] == pytest.approx(expected["grad_norm"], rel=step * bound), step
        assert records[step]["scale"] == pytest.approx(expected["scale"], rel=bound), step
        assert records[step]["lr"] == expected["lr"], step


def launch(cwd, world: int, *arguments: str) -> None:
    if world == 1:
        one_process(cwd, *arguments)
    else:
        torchrun(cwd, *arguments, world=world)


@pytest.mark.slow
@pytest.mark.parametrize("first, then", [((2, "fsdp"), (1, "fsdp")), ((1, "fsdp"), (2, "fsdp")),
                                         ((2, "fsdp"), (1, "ddp")), ((1, "ddp"), (2, "fsdp"))])
def test_a_run_resumes_on_another_world_size_or_parallelism_and_takes_the_unsharded_steps(tmp_path, unsharded,
                                                                                          first, then):
    run = tmp_path / "run"
    settings = [s for s in FSDP if s != "train.parallelism=fsdp"] + [f"train.parallelism={first[1]}", "train.steps=2"]
    launch(tmp_path, first[0], "--preset", "tiny", *flags(settings), "--out", str(run))
    step_two = run / "checkpoints" / "step-000002"
    # A sharded run's checkpoint: the weights whole (any reader's), the optimiser state one safetensors file a rank.
    shards = sorted(path.name for path in (step_two / "optimizer").glob("*.safetensors")) if first[1] == "fsdp" else []
    assert len(shards) == first[0] if first[1] == "fsdp" else not (step_two / "optimizer").exists()
    launch(tmp_path, then[0], "--resume", str(run), "--set", "train.steps=4", "--set", f"train.parallelism={then[1]}")
    assert_same_steps(run, unsharded)
    model, tokenizer, config = load_checkpoint(run / "checkpoints" / "step-000004")  # no FSDP needed to read it
    assert config.train.parallelism == then[1] and tokenizer is not None
    assert json.loads((run / "eval.json").read_text())


@pytest.mark.slow
def test_sharding_over_two_processes_halves_each_ranks_optimizer_state():
    # benchmarks/fsdp_memory.py on the tiny preset: exact byte counts of what each rank holds after one step.
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "fsdp_memory.py"
    done = subprocess.run([sys.executable, str(script), "--preset", "tiny", "--worlds", "1,2"], env=launch_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    results = {(r["parallelism"], r["world"]): r for r in map(json.loads, (line for line in done.stdout.splitlines()
                                                                            if line.startswith('{"benchmark"')))}
    whole = results["ddp", 1]["per_rank"][0]
    for kind in ("parameters", "gradients", "optimizer"):
        assert results["ddp", 2]["per_rank"][0][kind] == results["fsdp", 1]["per_rank"][0][kind] == whole[kind]
    # FSDP2 gives rank r rows [r·c, (r+1)·c) of each parameter's dim 0, c = ceil(rows / 2); 0-d ones stay whole.
    # fp32: 4 bytes an element; AdamW keeps two moments of the shard and a 0-d step count per parameter.
    shapes = [p.shape for p in CLIP(load_config("tiny").model).parameters()]
    for rank, held in enumerate(results["fsdp", 2]["per_rank"]):
        elements = sum(math.prod(shape) if not shape else
                       max(0, min(shape[0], (rank + 1) * -(-shape[0] // 2)) - rank * -(-shape[0] // 2))
                       * math.prod(shape[1:]) for shape in shapes)
        assert held["parameters"] == held["gradients"] == 4 * elements
        assert held["optimizer"] == 4 * (2 * elements + len(shapes))
        assert held["optimizer"] < 0.52 * whole["optimizer"]  # about half of DDP's, as the issue asks


@pytest.mark.slow
def test_a_damaged_optimizer_shard_falls_back_to_the_checkpoint_before(tmp_path):
    run = tmp_path / "run"
    one_process(tmp_path, "--preset", "tiny", *flags(FSDP + ["train.steps=2"]), "--out", str(run))
    (shard,) = (run / "checkpoints" / "step-000002" / "optimizer").glob("*.safetensors")
    shard.write_bytes(shard.read_bytes()[:100])  # cut: the header promises more than the file holds
    done = subprocess.run([sys.executable, "-m", "topoclip", "train", "--resume", str(run), "--set", "train.steps=3"],
                          cwd=tmp_path, env=launch_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "skipping damaged checkpoint step-000002" in done.stderr and "resuming from step-000001" in done.stdout
    assert [r["step"] for r in step_records(run)][-1] == 3


@pytest.mark.slow
def test_twenty_sharded_steps_equal_ddps_and_a_killed_run_continues_them_on_one_process(tmp_path):
    # The check: 2 processes under FSDP and under DDP from the same seed log the same losses for 20 steps;
    # the FSDP run killed with SIGKILL after its step-10 checkpoint and resumed on 1 process continues them.
    settings = SETTINGS + ["train.steps=20", "train.checkpoint_every=10", "train.batch_size=16",
                           "data.scenes.train_size=512"]
    for parallelism in ("ddp", "fsdp"):
        torchrun(tmp_path, "--preset", "tiny", *flags(settings + [f"train.parallelism={parallelism}"]),
                 "--out", str(tmp_path / parallelism))
    ddp, fsdp = ({r["step"]: r["loss"] for r in step_records(tmp_path / name)} for name in ("ddp", "fsdp"))
    # Per step the bound of tests/training/test_train_distributed.py (batch 16), growing with the updates behind it.
    bound = 2 * gamma(model_roundings(TINY, 16))
    assert sorted(ddp) == sorted(fsdp) == list(range(1, 21))
    for step in ddp:
        assert fsdp[step] == pytest.approx(ddp[step], rel=step * bound), step
    killed = tmp_path / "killed"  # killed with SIGKILL (torchrun and both ranks) once step 10's checkpoint is written
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "topoclip",
               "train", "--preset", "tiny", *flags(settings + ["train.parallelism=fsdp"]), "--out", str(killed),
               "--quiet"]
    launcher = subprocess.Popen(command, cwd=tmp_path, env=launch_env(), start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (killed / "checkpoints" / "step-000010").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    ranks = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
    os.killpg(launcher.pid, signal.SIGKILL)  # torchrun, and each rank: torchrun starts them in sessions of their own
    for rank in ranks:
        try:
            os.kill(int(rank), signal.SIGKILL)
        except ProcessLookupError:
            pass
    launcher.wait()
    assert sorted(path.name for path in (killed / "checkpoints").iterdir())[-1] == "step-000010"  # steps left
    one_process(tmp_path, "--resume", str(killed))
    resumed = {r["step"]: r["loss"] for r in step_records(killed)}
    for step in range(11, 21):
        assert resumed[step] == pytest.approx(fsdp[step], rel=step * bound), step


@pytest.mark.slow
def test_a_checkpoint_saved_before_the_first_update_resumes(tmp_path):
    # fp16's loss scaler skips the first steps (overflow at scale 2^16), so their checkpoints hold an optimiser that
    # has taken no step: nothing to shard. Resuming from one must work, as under DDP, and not step the optimiser.
    run = tmp_path / "run"
    one_process(tmp_path, "--preset", "tiny", *flags(FSDP + ["train.steps=4", "train.precision=fp16"]), "--out", str(run))
    assert not (run / "checkpoints" / "step-000001" / "optimizer").exists()
    for late in ("step-000002", "step-000003", "step-000004"):
        subprocess.run(["rm", "-r", str(run / "checkpoints" / late)], check=True)
    (run / "eval.json").unlink()
    done = subprocess.run([sys.executable, "-m", "topoclip", "train", "--resume", str(run)], cwd=tmp_path,
                          env=launch_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0 and "resuming from step-000001" in done.stdout, done.stderr[-3000:]


@pytest.mark.slow
def test_a_compiled_sharded_run_starts_from_a_checkpoint_as_an_unsharded_one(tmp_path):
    # --init-from loads the weights before they are sharded; torch.compile then runs over the sharded model. Its
    # steps are the eager unsharded run's within the bound used above (inductor reorders the same fp32 sums).
    start = tmp_path / "start"
    one_process(tmp_path, "--preset", "tiny", *flags(SETTINGS + ["train.steps=1"]), "--out", str(start))
    checkpoint = str(start / "checkpoints" / "step-000001")
    for name, extra, timeout in (("plain", [], LAUNCH_TIMEOUT_S),
                                 ("sharded", ["train.parallelism=fsdp", "train.compile=true"], COMPILED_TIMEOUT_S)):
        one_process(tmp_path, "--init-from", checkpoint, *flags(SETTINGS + ["train.steps=2"] + extra),
                    "--out", str(tmp_path / name), timeout=timeout)
    plain, sharded = ({r["step"]: r for r in step_records(tmp_path / name)} for name in ("plain", "sharded"))
    bound = 2 * gamma(model_roundings(TINY, 8))
    assert sorted(plain) == sorted(sharded) == [1, 2]
    for step in (1, 2):
        assert sharded[step]["loss"] == pytest.approx(plain[step]["loss"], rel=step * bound), step
        assert sharded[step]["grad_norm"] == pytest.approx(plain[step]["grad_norm"], rel=step * bound), step
