"""A resumed run continues its user data exactly where the killed run was (issue #16 item 4).

Before: a CSV / shard stream restarted at epoch 0 on every resume, so a run resumed ten times trained
ten times on the head of its data. Now every batch carries each DataLoader worker's position in its
share of the epoch, checkpoints store every rank's, and a resumed worker skips what was trained on
without decoding it; crops are seeded per sample, so the resumed steps see the same pixels too.
"""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from topoclip.config import load_config
from topoclip.data.shard_writer import shard_pattern, write_shards
from topoclip.data.batch import RawBatch
from topoclip.data.quality import DataQualityError
from topoclip.data.streams import SharedEpoch, StreamPosition, stream_batches
from topoclip.run.training.data import training_batches

from test_train_user_data import scene_samples

RUNNER = Path(__file__).resolve().parents[1] / "_stream_run.py"
BATCH = 4
ROWS = 30  # 7 batches an epoch (2 rows dropped): a few steps cross epochs


@pytest.fixture(scope="module")
def samples():
    return scene_samples(ROWS)


def write_csv(folder: Path, samples) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["filepath,title"]
    for i, (png, caption) in enumerate(samples):
        (folder / f"{i}.png").write_bytes(png)
        lines.append(f"{i}.png,{caption}")
    lines.insert(5, "missing.png,a row whose image is missing")  # a bad row: skipped, counted, and not replayed
    (folder / "data.csv").write_text("\n".join(lines) + "\n")
    return folder / "data.csv"


def write_dataset(folder: Path, samples) -> Path:
    """The samples as a Hugging Face dataset (save_to_disk), images as an Image feature, with one corrupt row."""
    datasets = pytest.importorskip("datasets")
    rows = [{"image": {"bytes": png, "path": None}, "text": caption} for png, caption in samples]
    rows.insert(5, {"image": {"bytes": b"not an image", "path": None}, "text": "a row whose image is broken"})
    table = datasets.Dataset.from_list(rows, features=datasets.Features({"image": datasets.Image(),
                                                                        "text": datasets.Value("string")}))
    table.save_to_disk(str(folder / "dataset"))
    return folder / "dataset"


def data_settings(kind: str, folder: Path, samples) -> list[str]:
    if kind == "csv":
        return ["data.source=csv", f"data.train_data={write_csv(folder, samples)}"]
    if kind == "hf":
        return ["data.source=hf", f"data.train_data={write_dataset(folder, samples)}"]
    first = shard_pattern(write_shards(samples[:18], folder / "a", samples_per_shard=6, image_format="png"))
    second = shard_pattern(write_shards(samples[18:], folder / "b", samples_per_shard=4, image_format="png"))
    settings = ["data.source=shards", "data.shuffle_buffer=5"]
    if kind == "shards":
        return settings + [f"data.train_data={first}::{second}"]
    resampled = settings + ["data.resampled=true", "data.samples_per_epoch=24"]
    if kind == "resampled":
        return resampled + [f"data.train_data={first}"]
    return resampled + [f"data.train_data={first}::{second}", "data.weights=[1.0, 3.0]"]  # a weighted mixture


def config_for(kind: str, folder: Path, samples, workers: int, extra=()):
    return load_config("tiny", data_settings(kind, folder, samples) + [
        f"train.batch_size={BATCH}", f"train.num_workers={workers}", "data.tokenizer=", *extra])


def take(batches, count):
    return [next(batches) for _ in range(count)]


@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("kind", ["csv", "hf", "shards", "resampled", "weighted"])
def test_a_stream_resumed_at_any_step_continues_with_the_same_samples_and_pixels(kind, workers, samples, tmp_path):
    config = config_for(kind, tmp_path, samples, workers)
    steps, stop = 20, random.Random(f"{kind}{workers}").randrange(1, 19)
    whole = take(training_batches(config, 0), steps)

    position = StreamPosition(workers, 1)
    for batch in take(training_batches(config, 0), stop):
        position.advance(batch)
    state = json.loads(json.dumps(position.state()))  # as a checkpoint stores it
    resumed = take(training_batches(config, stop, stream=state), steps - stop)

    assert [b.keys for b in resumed] == [b.keys for b in whole[stop:]], f"stopped at {stop}"
    for got, expected in zip(resumed, whole[stop:]):
        assert torch.equal(got.images, expected.images)  # the same crop of the same image
    if kind in ("csv", "hf", "shards"):  # one pass an epoch: no sample twice within an epoch
        epochs = {}
        for batch in whole:
            epochs.setdefault(batch.positions[-1][0], []).extend(batch.keys)
        assert len(epochs) > 1 and all(len(keys) == len(set(keys)) for keys in epochs.values())


def test_a_stream_split_another_way_is_refused(samples, tmp_path):
    from topoclip.config import ConfigError

    with pytest.raises(ConfigError, match="same"):
        StreamPosition(2, 1, {"epoch": 0, "workers": {}, "last": 0, "num_workers": 1, "world_size": 1})


# ------------------------------------------------------------------------------- kill -9 and resume


def launch(keys: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(RUNNER), str(keys), *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r}


@pytest.mark.slow
@pytest.mark.parametrize("kind,workers", [("csv", 0), ("hf", 1), ("resampled", 2)])
def test_kill_9_at_a_random_step_then_resume_trains_what_an_uninterrupted_run_trains(kind, workers, samples, tmp_path):
    steps = 24
    settings = data_settings(kind, tmp_path / "data", samples) + [
        f"train.batch_size={BATCH}", f"train.num_workers={workers}", f"train.steps={steps}", "train.threads=1",
        "train.log_every=1", "train.checkpoint_every=1", "train.warmup_steps=2", "evaluate.size=8",
        'evaluate.template_modes=["distance"]']
    args = ["--preset", "tiny", "--quiet", *[part for s in settings for part in ("--set", s)]]

    whole = launch(tmp_path / "whole.jsonl", *args, "--out", str(tmp_path / "whole"))
    assert whole.wait(timeout=300) == 0, whole.stderr.read()[-3000:]

    kill_after = random.Random(kind).randrange(4, steps - 4)
    killed = launch(tmp_path / "killed.jsonl", *args, "--out", str(tmp_path / "run"))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and killed.poll() is None:
        if (tmp_path / "killed.jsonl").is_file() and len(read_jsonl(tmp_path / "killed.jsonl")) >= kill_after:
            killed.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    assert killed.wait(timeout=60) == -signal.SIGKILL, "the run ended before it could be killed"

    resumed = launch(tmp_path / "resumed.jsonl", "--resume", str(tmp_path / "run"), "--quiet")
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()[-3000:]

    restart = read_jsonl(tmp_path / "resumed.jsonl")[0]["step"]
    assert 1 < restart <= kill_after  # it resumed from a checkpoint of the killed run, not from the start
    trained = {r["step"]: r["keys"] for r in read_jsonl(tmp_path / "killed.jsonl") if r["step"] < restart}
    trained.update({r["step"]: r["keys"] for r in read_jsonl(tmp_path / "resumed.jsonl")})
    expected = {r["step"]: r["keys"] for r in read_jsonl(tmp_path / "whole.jsonl")}
    assert trained == expected
    assert step_losses(tmp_path / "run") == step_losses(tmp_path / "whole")  # bit for bit, every step
    final = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "data" in r][-1]["data"]
    assert final == [r for r in read_jsonl(tmp_path / "whole" / "metrics.jsonl") if "data" in r][-1]["data"]


class _Epochs(torch.utils.data.IterableDataset):
    """Yields (process, epoch, resume, first) of each iteration: what a worker sees of set_epoch."""

    def set_epoch(self, epoch, resume=None, first=0):
        self.epoch, self.resume, self.first = epoch, resume, first

    def __iter__(self):
        yield os.getpid(), self.epoch, self.resume, self.first


def test_kept_workers_read_each_epoch_the_main_process_sets():
    """A user-data stream's workers are kept from one epoch to the next (starting them again stalled the step at
    every epoch's start); the epoch reaches them through shared memory, the resumed one's positions only it."""
    dataset = SharedEpoch(_Epochs())
    dataset.set_epoch(3, {0: (5, 1)}, 1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1, persistent_workers=True)
    seen = []
    for epoch, resume, first in ((3, {0: (5, 1)}, 1), (4, None, 0), (5, None, 0)):
        dataset.set_epoch(epoch, resume, first)
        seen += list(loader)
    assert [item[1:] for item in seen] == [[3, {0: [5, 1]}, 1], [4, None, 0], [5, None, 0]]  # (tuples as lists)
    assert len({item[0] for item in seen}) == 1 and seen[0][0] != os.getpid()  # one worker, kept


class _GoodThenBad(torch.utils.data.IterableDataset):
    """Epoch 0: a good batch, then three bad samples (their count rides on the next batch); every later epoch: two
    bad samples and nothing usable."""

    def set_epoch(self, epoch, resume=None, first=0):
        self.epoch = epoch

    def __iter__(self):
        if self.epoch == 0:
            yield RawBatch(torch.zeros(1, 3, 4, 4), ["a"], {}, positions=[(0, 0, 1, 1)])
            yield RawBatch(torch.empty(0, 3, 0, 0), [], {"corrupt_image": 3}, positions=[(0, 0, 4, 1)])
        else:
            yield RawBatch(torch.empty(0, 3, 0, 0), [], {"corrupt_image": 2}, positions=[(self.epoch, 0, 2, 0)])


def test_an_epoch_with_no_usable_sample_counts_its_own_skips():
    """The error names what that epoch skipped, not the earlier epochs' skips that rode on its batches too."""
    config = load_config("tiny", ["train.num_workers=0"])
    batches = stream_batches(lambda data, **_: _GoodThenBad(), config, 0, 0, 1, {})
    assert len(next(batches)) == 1
    with pytest.raises(DataQualityError, match=r"no usable sample \(skipped: \{'corrupt_image': 2\}\)"):
        next(batches)
