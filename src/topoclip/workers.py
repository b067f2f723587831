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
