"""topoclip.workers: what forks DataLoader workers needs before (settle_before_fork) and in them (start_worker;
its tests are in test_hostile_inputs.py)."""
import threading
import time

from topoclip.workers import settle_before_fork


def test_a_feeder_thread_that_is_ending_ends_before_the_next_fork():
    # As a DataLoader's queue feeder after its shutdown: ending moments later (CPython gh-112275 makes a fork during
    # that moment hang the child on Python 3.11.7).
    ending = threading.Thread(target=time.sleep, args=(0.02,), name="QueueFeederThread", daemon=True)
    ending.start()
    settle_before_fork(timeout=5.0)
    assert not ending.is_alive()


def test_a_live_feeder_costs_at_most_the_timeout():
    stop = threading.Event()
    live = threading.Thread(target=stop.wait, name="QueueFeederThread", daemon=True)
    live.start()
    started = time.perf_counter()
    settle_before_fork(timeout=0.05)
    assert live.is_alive()
    stop.set()
    live.join()
    # Not a timing test: the bound is 4 s for one 0.05 s wait, however loaded the machine.
    assert time.perf_counter() - started < 4.0
