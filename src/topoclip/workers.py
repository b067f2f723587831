"""How topoclip starts DataLoader workers (`worker_options`) and what each does first (`start_worker`).

A forked worker (outside a process group) shares its parent's open files, the run folder's lock among them (a
flock belongs to the open file): one outliving a `kill -9`'d parent would keep the folder locked, naming a dead
process, until it noticed. So a worker closes its copies of the locks at once, and on Linux asks the kernel to
end it with its parent.
"""
from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist
import torch.multiprocessing

# Descriptors of the run-folder locks this process holds (topoclip.run_folder adds and removes them).
HELD_LOCKS: set[int] = set()

PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent ends


def start_worker(*_) -> None:
    """In a forked DataLoader worker: drop the parent's lock files and end with the parent."""
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
    needs multiprocessing's `if __name__ == "__main__":` guard), its tensors shared by file name (torch's
    "file_system" strategy, set for the process): by descriptor, the default, a dataset holding more than ~250
    tensors cannot start a worker, since the server gets all of a worker's descriptors in one message ("too many
    fds"). Outside a process group: plain fork, milliseconds."""
    if not workers:
        return {"num_workers": 0}
    options = {"num_workers": workers, "worker_init_fn": start_worker}
    if dist.is_available() and dist.is_initialized() and "forkserver" in multiprocessing.get_all_start_methods():
        from multiprocessing.reduction import ForkingPickler

        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["__main__", "torch"])  # (only read when the server starts)
        ForkingPickler.register(torch.Generator, _reduce_generator)  # the dataset now travels pickled
        torch.multiprocessing.set_sharing_strategy("file_system")
        options["multiprocessing_context"] = context
    return options


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
