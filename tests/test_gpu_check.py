"""benchmarks/gpu_check.py's CPU rehearsal (issue #45): every step of the GPU check runs on this machine, and the
resumed run's losses equal the uninterrupted run's."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_gpu_check_rehearses_every_step_on_the_cpu(tmp_path):
    out = tmp_path / "rehearsal"
    # The whole budget the test allows (the default, 480 s, is a GPU's): about 80 s on 2 quiet cores.
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--tiny",
                           "--budget", "560", "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    report = json.loads((out / "check.json").read_text())
    assert done.returncode == 0 and report["passed"], (out / "report.txt").read_text()
    resume = report["steps"]["training"]["resume_losses"]
    assert resume["steps_compared"] >= 5 and resume["largest_relative_difference"] == 0.0
    assert (out / "report.txt").read_text().startswith("GPU check on cpu")
    assert {"loader", "shards_workers", "epoch_start", "profile_tiny", "nccl_fsdp", "nccl_ddp", "fsdp_memory",
            "step_lorentz", "step_lorentz_product"} <= set(report["steps"])
    hyperbolic = [line for line in report["steps"]["step_lorentz_product"]["json"] if line.get("benchmark") == "mfu"]
    assert hyperbolic[0]["overrides"] == ["model.topology=lorentz-product", "train.entailment_weight=0.2"]
    assert json.loads((out / "loader.json").read_text())["sizes"]["256"]["paths"]["topoclip"]["per_worker"] > 0
    starts = json.loads((out / "epoch-start.json").read_text())["measurements"]
    assert len(starts[0]["epoch_start_gap_ms"]) == 2 and [m["shuffle_buffer"] for m in starts[1:]] == [1, 1000]


def test_a_spent_budget_skips_every_step_and_still_writes_the_report(tmp_path):
    # A GPU is lent for minutes: the check must end inside --budget and keep a report of what it did not run.
    out = tmp_path / "none"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--tiny",
                           "--budget", "0", "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    report = json.loads((out / "check.json").read_text())
    assert done.returncode == 1 and not report["passed"]
    assert report["cpu"]["logical_cores"] == os.cpu_count()  # what the loader's workers share, recorded with the run
    assert report["steps"]["gpu_tests"]["status"] == report["steps"]["step_compiled"]["status"] == "skipped"
    assert not (out / "killed").exists()  # the SIGKILL run is not started either


def test_epoch_starts_are_the_gaps_before_each_epochs_first_batch():
    """benchmarks/epoch_start.py's reading of batch arrivals: epochs of 3 batches, each epoch's first batch 0.5 s
    after the last of the one before, 0.1 s between the batches inside; the first epoch (the workers' start) aside."""
    spec = importlib.util.spec_from_file_location("epoch_start", ROOT / "benchmarks" / "epoch_start.py")
    epoch_start = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(epoch_start)
    arrivals, now = [], 0.0
    for epoch in range(4):
        for batch in range(3):
            now += (9.0 if epoch == 0 else 0.5) if batch == 0 else 0.1
            arrivals.append(now)
    starts, inside = epoch_start.epoch_gaps(arrivals, 3)
    assert starts == pytest.approx([0.5, 0.5, 0.5]) and inside == pytest.approx([0.1] * 6)  # sums of 0.1s and 0.5s
