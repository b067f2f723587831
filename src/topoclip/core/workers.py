"""How topoclip starts DataLoader workers (`worker_options`), how many (`loader_workers`) and what each does first
(`start_worker`).

A forked worker (outside a process group) shares its parent's open files, the run folder's lock among them (a
flock belongs to the open file): one outliving a `kill -9`'d parent would keep the folder locked, naming a dead
process, until it noticed. So a worker closes its copies of the locks at once, and on Linux asks the kernel to
end it with its parent.
"""
from __future__ import annotations

import ctypes
import functools
import multiprocessing
import multiprocessing.context
import os
import select
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing

# train.num_workers="auto" gives at most this many workers a process: the loader benchmark's 256 px path delivers
# ~1,200 img/s a worker here, so 16 feed a step of ~20,000 img/s (docs/many-gpus.md), more than one GPU's ViT-B/16.
AUTO_WORKERS_MAX = 16


def loader_workers(setting) -> int:
    """train.num_workers as a number: itself, or for "auto" the CPUs this process may run on (its affinity) shared
    among the node's training processes (torchrun's LOCAL_WORLD_SIZE), one core left for each process itself: at
    least 1, at most AUTO_WORKERS_MAX."""
    if setting != "auto":
        return setting
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(AUTO_WORKERS_MAX, cpus // local - 1))


# Descriptors of the run-folder locks this process holds (topoclip.io.run_folder adds and removes them).
HELD_LOCKS: set[int] = set()

PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent ends


def start_worker(*_, loader_process: int | None = None) -> None:
    """In a DataLoader worker: drop the parent's lock files and end with the parent, or, started from a fork server
    (whose child it is, and which outlives a killed training process while its workers live), with
    `loader_process`, the process iterating the DataLoader."""
    if loader_process is not None and loader_process != os.getppid():
        _end_with(loader_process)
    for descriptor in list(HELD_LOCKS):
        try:
            os.close(descriptor)
        except OSError:
            pass
    HELD_LOCKS.clear()
    if sys.platform.startswith("linux"):
        parent = os.getppid()
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # no prctl: the worker ends when it next finds its queue closed
            return
        if os.getppid() != parent:  # the parent ended before prctl took effect
            os._exit(0)


def worker_options(workers: int) -> dict:
    """A DataLoader's keyword arguments for `workers` worker processes ({"num_workers": 0}: none).

    Under torch.distributed the workers start from a fork server, not as forks of this process: gloo's (or
    NCCL's) own threads run beside the loop there, and a fork copies whatever lock one of them holds at that
    moment into the child, held forever (the likely cause of a 2-rank final evaluation that hung in CI). The
    server is a process of one thread with torch imported before it forks, so a worker starts in about 0.3 s
    (2 s for the server, once a process). The dataset then travels pickled (no lambdas in a transform; a script
    needs multiprocessing's `if __name__ == "__main__":` guard), its tensors shared by file name (_WorkerProcess);
    a worker ends with the process iterating the loader (start_worker). Outside a process group: plain fork,
    milliseconds."""
    if not workers:
        return {"num_workers": 0}
    options = {"num_workers": workers, "worker_init_fn": start_worker}
    if dist.is_available() and dist.is_initialized() and "forkserver" in multiprocessing.get_all_start_methods():
        from multiprocessing.reduction import ForkingPickler

        context = _ForkServerContext()
        context.set_forkserver_preload(["__main__", "torch"])  # (only read when the server starts)
        ForkingPickler.register(torch.Generator, _reduce_generator)  # the dataset now travels pickled
        options.update(multiprocessing_context=context,
                       worker_init_fn=functools.partial(start_worker, loader_process=os.getpid()))
    return options


if "forkserver" in multiprocessing.get_all_start_methods():
    class _WorkerProcess(multiprocessing.context.ForkServerProcess):
        """A fork-server worker whose start pickles the dataset's tensors by file name (torch's "file_system"
        sharing strategy) and no others: by descriptor, a dataset of more than ~250 tensors cannot start one (the
        server gets all of a worker's descriptors in one message: "too many fds"). Named files outlive a job
        killed whole with SIGKILL (torch_shm_manager too) in /dev/shm, so the process keeps torch's default for
        everything else, the batches its workers send back included."""

        def start(self) -> None:
            previous = torch.multiprocessing.get_sharing_strategy()
            torch.multiprocessing.set_sharing_strategy("file_system")
            try:
                super().start()
            finally:
                torch.multiprocessing.set_sharing_strategy(previous)

    class _ForkServerContext(multiprocessing.context.ForkServerContext):
        Process = _WorkerProcess


def _end_with(pid: int) -> None:
    """End this process (at once, as a killed parent's fork would) when process `pid` ends: a pidfd where Linux has
    one, else a poll each second."""
    try:
        handle = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (macOS, Linux < 5.3), or pid already gone
        handle = None

    def watch() -> None:
        if handle is not None:
            select.select([handle], [], [])
        else:
            while True:
                try:
                    os.kill(pid, 0)
                except (ProcessLookupError, PermissionError):  # gone, or its pid now another user's process
                    break
                time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="topoclip-end-with-loader", daemon=True).start()


def _reduce_generator(generator):
    # torch's own reduction sends the state as a temporary tensor in shared memory, freed before the worker maps it
    # (the worker dies: "unable to resize file ... Invalid argument", torch 2.13); as bytes it arrives whole.
    return _generator, (str(generator.device), generator.get_state().numpy().tobytes())


def _generator(device: str, state: bytes):
    generator = torch.Generator(device)
    generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return generator


def settle_before_fork(timeout: float = 0.05) -> None:
    """Before a new DataLoader forks its workers: let the queue feeder threads of the last one end first.

    On CPython before the fix of gh-112275 (3.11.7 here and in CI) a fork while another thread is ending can leave
    the child waiting forever on the runtime's head lock, copied held. A DataLoader's feeder threads end just after
    it shuts down, so the next one's fork raced them: seen as a hung final evaluation, which runs one DataLoader
    per set. Joining them (each at most `timeout` s; a live queue's feeder costs that wait) closes that window."""
    for thread in threading.enumerate():
        if thread.name == "QueueFeederThread" and thread is not threading.current_thread():
            thread.join(timeout)
