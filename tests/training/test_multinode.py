"""Two nodes, simulated on this machine (issue #59): two `torchrun --nnodes 2` launchers of one process each, met
through torchrun's c10d rendezvous on loopback, gloo between them, as two machines of a cluster would run
`topoclip train` (the README's multi-node command). What a user's cluster must see: the losses of one node
running both processes on the same global batch (DDP and FSDP), one run folder written by global rank 0 alone,
each node's DataLoader workers reading their own share of the data, a node killed with SIGKILL ending the other
in bounded time with a non-zero status, and that run resumed on one node continuing the losses."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from topoclip.run.training.logger import read_metrics

from _launch import LAUNCH_TIMEOUT_S, descendants, free_port, launch_env, signal_all, torchrun

HERE = Path(__file__).resolve().parent
STREAM_RUN = HERE.parent / "_stream_run.py"  # `topoclip train` that logs each step's sample keys
SETTINGS = ["train.threads=1", "train.batch_size=8", "train.log_every=1", "train.checkpoint_every=1",
            "train.keep_checkpoints=10", "train.warmup_steps=1", "evaluate.size=16", 'evaluate.template_modes=["distance"]',
            "evaluate.captions_per_image=2", "train.eval_every=0"]


def node_command(port: int, node: int, program: list[str]) -> list[str]:
    """One node's launcher: torchrun with two nodes of one process, c10d rendezvous at node 0 (which hosts it)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
            str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "topoclip-test",
            "--rdzv-conf", f"is_host={str(node == 0).lower()}", "--max-restarts", "0", *program]


def start_nodes(cwd: Path, program: list[str]) -> list[subprocess.Popen]:
    port = free_port()
    return [subprocess.Popen(node_command(port, node, program), cwd=cwd, env={**launch_env(), "PYTHONFAULTHANDLER": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
            for node in (0, 1)]


def finish(nodes: list[subprocess.Popen], timeout: float = LAUNCH_TIMEOUT_S) -> list[tuple[int, str, str]]:
    """(status, stdout, stderr) of each node; every process of both ended (SIGKILL) past the timeout."""
    deadline, results = time.monotonic() + timeout, []
    for node in nodes:
        try:
            stdout, stderr = node.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in nodes:
                signal_all([other.pid, *descendants(other.pid)], signal.SIGKILL)
            stdout, stderr = node.communicate(timeout=60)
            raise AssertionError(f"a node ran past {timeout} s:\n{stdout[-2000:]}\n{stderr[-4000:]}") from None
        results.append((node.returncode, stdout, stderr))
    return results


def train_on_two_nodes(cwd: Path, *arguments: str, script: Path = None) -> list[tuple[int, str, str]]:
    program = [str(script), *arguments] if script else ["-m", "topoclip", "train", *arguments, "--quiet"]
    results = finish(start_nodes(cwd, program))
    assert all(status == 0 for status, _, _ in results), "a node failed:\n" + "\n".join(
        f"node {node} ({status}):\n{stdout[-2000:]}\n{stderr[-5000:]}" for node, (status, stdout, stderr) in enumerate(results))
    return results


def losses(run: Path) -> list[tuple[int, float, dict]]:
    return [(r["step"], r["loss"], r["data"]) for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def settings(*extra: str) -> list[str]:
    return [part for setting in (*SETTINGS, *extra) for part in ("--set", setting)]


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_two_nodes_take_one_nodes_steps_and_write_one_folder(tmp_path, parallelism):
    extra = ["train.num_workers=0", f"train.parallelism={parallelism}", "train.steps=3"]
    two, one = tmp_path / "two-nodes", tmp_path / "one-node"
    train_on_two_nodes(tmp_path, "--preset", "tiny", *settings(*extra), "--out", str(two))
    torchrun(tmp_path, "--preset", "tiny", *settings(*extra), "--out", str(one))
    # The same two processes on the same global batch: only where they run differs. Each rank's work depends on its
    # rank alone, and an all-reduce of two ranks adds two numbers, which is exact in either order (a + b = b + a in
    # IEEE arithmetic), so the same floats.
    assert losses(two) == losses(one) and [s for s, _, _ in losses(two)] == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one-node", "two-nodes"]  # one folder a launch
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == [f"step-00000{s}" for s in (1, 2, 3)]
    assert sum(1 for r in read_metrics(two / "metrics.jsonl") if r.get("final")) == 1  # rank 0 alone logged


@pytest.mark.slow
def test_each_nodes_workers_read_their_own_share(tmp_path):
    """A CSV stream read by 2 DataLoader workers on each node: in the first epoch (3 steps of 4 samples a node, of
    33 rows), no row is read twice, by the same node or the other."""
    from test_resume_stream import write_csv
    from test_train_user_data import scene_samples

    table = write_csv(tmp_path / "data", scene_samples(32))
    keys = tmp_path / "keys.jsonl"
    train_on_two_nodes(tmp_path, str(keys), "--preset", "tiny", *settings(
        "data.source=csv", f"data.train_data={table}", "data.tokenizer=", "train.num_workers=2", "train.steps=3"),
        "--out", str(tmp_path / "run"), script=STREAM_RUN)
    records = [json.loads(line) for line in keys.read_text().splitlines()]  # each node's process writes its own
    assert sorted(record["step"] for record in records) == [1, 1, 2, 2, 3, 3]
    seen = [key for record in records for key in record["keys"]]
    assert len(seen) == 24 and len(set(seen)) == 24  # the nodes (and each node's workers) read apart


@pytest.mark.slow
def test_a_killed_node_ends_the_other_and_the_run_resumes_on_one_node(tmp_path):
    extra = ["train.num_workers=0", "train.steps=200", "train.checkpoint_every=2"]
    whole, run = tmp_path / "whole", tmp_path / "run"
    torchrun(tmp_path, "--preset", "tiny", *settings(*extra), "--out", str(whole))
    nodes = start_nodes(tmp_path, ["-m", "topoclip", "train", "--preset", "tiny", *settings(*extra), "--out", str(run),
                                   "--quiet"])
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while not any((run / "checkpoints").glob("step-0000[0-9][02468]")) and time.monotonic() < deadline:
        time.sleep(0.2)  # until a checkpoint is written: the run is under way on both nodes
    assert any((run / "checkpoints").glob("step-*")), "no checkpoint before the deadline"
    signal_all([nodes[1].pid, *descendants(nodes[1].pid)], signal.SIGKILL)
    (status, _, stderr), _ = finish(nodes, timeout=120)  # node 0 must end, not wait on a peer that is gone
    assert status != 0, "the surviving node reported success"
    assert not (run / "eval.json").exists()
    torchrun(tmp_path, "--resume", str(run))  # both processes on one node now: the same world, the same ranks
    resumed, expected = losses(run), losses(whole)
    assert [s for s, _, _ in resumed] == list(range(1, 201))
    assert resumed == expected
