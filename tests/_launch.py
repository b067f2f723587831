"""Starting `topoclip train` under torchrun from a test: 2 (or N) gloo processes on the CPU, on loopback."""
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

LAUNCH_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env() -> dict:
    """This process's environment without a launcher's variables; one thread; gloo on loopback (a sandbox without
    DNS cannot resolve the host name gloo binds to otherwise)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    return env


def torchrun(cwd, *arguments: str, world: int = 2, script=None) -> subprocess.CompletedProcess:
    """`topoclip train ARGUMENTS --quiet` (or `python SCRIPT ARGUMENTS`) in `world` processes; fails the test with the
    output when it fails."""
    program = [str(script), *arguments] if script else ["-m", "topoclip", "train", *arguments, "--quiet"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *program]
    # A launch takes ~10 s; one past the timeout hangs. Then every process of it (torchrun starts each rank in a
    # session of its own) prints where each of its threads stands (faulthandler, on SIGABRT) before the test fails,
    # so a rare hang in CI names its place; SIGKILL follows for any that SIGABRT did not end.
    with subprocess.Popen(command, cwd=cwd, env={**launch_env(), "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            processes = [process.pid, *descendants(process.pid)]
            signal_all(processes, signal.SIGABRT)
            try:
                stdout, stderr = process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                signal_all(processes, signal.SIGKILL)
                stdout, stderr = process.communicate(timeout=60)
            raise AssertionError(f"torchrun hung past {LAUNCH_TIMEOUT_S} s; the stacks of its processes:\n"
                                 f"{stdout[-3000:]}\n{stderr[-20000:]}") from None
    done = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    assert done.returncode == 0, f"torchrun failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux: /proc/PID/task/TID/children; elsewhere none)."""
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(child) for child in children.read_text().split()]
        except OSError:  # the thread ended meanwhile
            continue
    return [p for child in found for p in (child, *descendants(child))]


def signal_all(processes: list[int], number: int) -> None:
    for pid in processes:
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass
