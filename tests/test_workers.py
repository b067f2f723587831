"""topoclip.core.workers: how DataLoader workers start (worker_options), what a fork needs before (settle_before_fork)
and what a worker does first (start_worker; its tests are in test_hostile_inputs.py)."""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from topoclip.core.workers import settle_before_fork, worker_options

from _launch import free_port, launch_env


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


def test_one_process_forks_its_workers_and_no_workers_need_no_options():
    assert worker_options(0) == {"num_workers": 0}
    options = worker_options(2)
    assert options["num_workers"] == 2 and "multiprocessing_context" not in options  # plain fork, milliseconds


# Run in a process of its own: a gloo group of one (as `topoclip train` under torchrun has), then every DataLoader
# topoclip makes, with 2 workers and with none. A worker returns its parent's pid, so the test sees who forked it.
UNDER_TORCH_DISTRIBUTED = """
import os, sys
import numpy as np, torch, torch.distributed as dist
from PIL import Image
from topoclip.data.folders import LazyImages
from topoclip.data.scene_batches import AugmentedScenes, RenderedScenes, collate
from topoclip.data.scenes import SceneConfig, SceneDataset
from topoclip.run.evaluation.zeroshot import _pixel_batches
from topoclip.preprocess.transforms import eval_transform, train_transform
from topoclip.core.workers import worker_options
from parents import Many, Parent

def loaders(workers, folder):
    paths = []
    for i in range(6):
        paths.append(os.path.join(folder, f"{i}.png"))
        Image.fromarray(np.full((40, 40, 3), 40 * i, np.uint8)).save(paths[-1])
    yield "evaluation", torch.cat(list(_pixel_batches(LazyImages(paths), eval_transform(32), 4, 0, 6, workers)))
    scenes = SceneDataset(SceneConfig(train_size=64, val_size=8, test_size=8, image_size=32), "train")
    yield "rendered scenes", RenderedScenes(scenes, torch.arange(40), workers, chunk=10).images
    generator = torch.Generator()
    augmented = AugmentedScenes(scenes, train_transform(32, generator=generator), generator, 0)
    loader = torch.utils.data.DataLoader(augmented, batch_size=8, collate_fn=collate, sampler=[(0, i) for i in range(16)],
                                         **worker_options(workers))
    yield "augmented scenes", torch.cat([batch.images for batch in loader])
    yield "parents", torch.tensor(list(torch.utils.data.DataLoader(Parent(), batch_size=None, **worker_options(workers))))
    yield "many tensors", torch.cat(list(torch.utils.data.DataLoader(Many(), batch_size=100, **worker_options(workers))))

if __name__ == "__main__":
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
    assert "multiprocessing_context" in worker_options(2)
    with_workers, without = dict(loaders(2, sys.argv[2])), dict(loaders(0, sys.argv[2]))
    for name in with_workers:
        if name != "parents":
            assert torch.equal(with_workers[name], without[name]), name
    assert (with_workers["parents"] != os.getpid()).all() and (without["parents"] == os.getppid()).all()
    dist.destroy_process_group()
    print("ok")
"""

PARENTS = """
import os, torch

class Parent(torch.utils.data.Dataset):  # i -> the pid of the process that made this one
    def __len__(self): return 4
    def __getitem__(self, i): return os.getppid()

class Many(torch.utils.data.Dataset):  # a user's dataset of many tensors (past the ~250 descriptors one message carries)
    def __init__(self): self.items = [torch.full((2,), float(i)) for i in range(1000)]
    def __len__(self): return len(self.items)
    def __getitem__(self, i): return self.items[i]
"""


@pytest.mark.slow
def test_under_torch_distributed_every_loader_starts_its_workers_from_a_fork_server(tmp_path):
    # A worker forked from a process that runs gloo's threads can inherit one of their locks held (a hung final
    # evaluation, CI): each loader's workers must come from the fork server and give what no workers give.
    (tmp_path / "parents.py").write_text(PARENTS)
    (tmp_path / "script.py").write_text(UNDER_TORCH_DISTRIBUTED)
    env = {**launch_env(), "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(tmp_path / "script.py"), str(free_port()), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout[-2000:] + done.stderr[-4000:]


def test_images_already_in_memory_are_transformed_without_workers(monkeypatch):
    # The built-in scenes' evaluation sets are lists of decoded images: a worker would only add its start-up (and
    # a fork); the batches are the same.
    from PIL import Image

    from topoclip.run.evaluation import zeroshot
    from topoclip.preprocess.transforms import eval_transform

    images = [Image.fromarray(np.full((40, 40, 3), 30 * i, np.uint8)) for i in range(5)]
    expected = torch.cat(list(zeroshot._pixel_batches(images, eval_transform(32), 2, 0, 5, workers=0)))
    monkeypatch.setattr(zeroshot.torch.utils.data, "DataLoader", None)  # any DataLoader would fail
    for kind in (list, tuple, lambda items: np.stack([np.asarray(image) for image in items])):
        batches = list(zeroshot._pixel_batches(kind(images), eval_transform(32), 2, 0, 5, workers=2))
        assert [len(b) for b in batches] == [2, 2, 1] and torch.equal(torch.cat(batches), expected)


def test_a_generator_travels_to_a_fork_servers_worker_with_its_state():
    import pickle

    from topoclip.core.workers import _reduce_generator

    generator = torch.Generator().manual_seed(7)
    torch.rand(3, generator=generator)  # a state that is not a seed's
    rebuild, arguments = _reduce_generator(generator)
    copy = rebuild(*pickle.loads(pickle.dumps(arguments)))  # plain bytes: no tensor, no shared memory
    assert torch.equal(torch.rand(5, generator=copy), torch.rand(5, generator=generator))


KILLED_MID_EPOCH = """
import sys, time, torch, torch.distributed as dist
from topoclip.core.workers import worker_options
from parents import Many

if __name__ == "__main__":
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
    iterator = iter(torch.utils.data.DataLoader(Many(), batch_size=10, **worker_options(2)))
    next(iterator)
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"  # named files for the dataset only
    print(" ".join(str(worker.pid) for worker in iterator._workers), flush=True)
    time.sleep(300)
"""


def _ended(pid: int) -> bool:
    try:
        return "\tZ" in Path(f"/proc/{pid}/status").read_text()  # a zombie no one reaps has ended too
    except FileNotFoundError:
        return True


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and /dev/shm")
def test_a_killed_training_process_takes_its_fork_server_workers_and_their_shared_files_with_it(tmp_path):
    # A fork server's worker is the server's child, and the server lives while its workers do: killed with SIGKILL,
    # the process iterating the loader left both running, holding the dataset's 1,000 named files in /dev/shm.
    (tmp_path / "parents.py").write_text(PARENTS)
    (tmp_path / "script.py").write_text(KILLED_MID_EPOCH)
    env = {**launch_env(), "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    before = set(os.listdir("/dev/shm"))
    process = subprocess.Popen([sys.executable, str(tmp_path / "script.py"), str(free_port())], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        workers = [int(pid) for pid in process.stdout.readline().split()]
        assert len(workers) == 2, process.stderr.read()[-3000:]
        assert len(set(os.listdir("/dev/shm")) - before) >= 1000  # the dataset's tensors, by name
        process.kill()
        process.wait()
        deadline = time.monotonic() + 60  # a pidfd wakes the watcher at once; 60 s for any load on the machine
        while time.monotonic() < deadline and not (all(map(_ended, workers))
                                                    and not {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("torch_")}):
            time.sleep(0.2)
        assert all(map(_ended, workers))
        assert not {name for name in set(os.listdir("/dev/shm")) - before if name.startswith("torch_")}
    finally:
        process.kill()
        for pid in workers if "workers" in locals() else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_auto_sizes_the_workers_from_the_cpus_this_process_may_use(monkeypatch):
    """train.num_workers="auto": the CPUs of this process's affinity shared among the node's training processes, one
    core left for each process, at least 1 and at most AUTO_WORKERS_MAX; a number stays itself."""
    from topoclip.config import ConfigError, load_config
    from topoclip.core import workers

    monkeypatch.setattr(workers.os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert workers.loader_workers("auto") == workers.AUTO_WORKERS_MAX  # 31 would be too many for one process
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert workers.loader_workers("auto") == 7  # 32 CPUs, 4 GPUs' processes: 8 each, one for the process itself
    monkeypatch.setattr(workers.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert workers.loader_workers("auto") == 1 and workers.loader_workers(3) == 3
    assert load_config("tiny", ["train.num_workers=auto"]).train.num_workers == "auto"
    with pytest.raises(ConfigError, match="train.num_workers"):
        load_config("tiny", ["train.num_workers=many"])
