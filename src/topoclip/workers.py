"""What every DataLoader worker of topoclip does first (`worker_init_fn=start_worker`).

A forked worker shares its parent's open files, the run folder's lock among them (a flock belongs to the open
file): one outliving a `kill -9`'d parent would keep the folder locked, naming a dead process, until it noticed.
So a worker closes its copies of the locks at once, and on Linux asks the kernel to end it with its parent.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

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


def settle_before_fork(timeout: float = 0.05) -> None:
    """Before a new DataLoader forks its workers: let the queue feeder threads of the last one end first.

    On CPython before the fix of gh-112275 (3.11.7 here and in CI) a fork while another thread is ending can leave
    the child waiting forever on the runtime's head lock, copied held. A DataLoader's feeder threads end just after
    it shuts down, so the next one's fork raced them: seen as a hung final evaluation, which runs one DataLoader
    per set. Joining them (each at most `timeout` s; a live queue's feeder costs that wait) closes that window."""
    for thread in threading.enumerate():
        if thread.name == "QueueFeederThread" and thread is not threading.current_thread():
            thread.join(timeout)
