"""A user data stream's training batches (CSV, WebDataset shards): read in order, tokenized in the loader's
workers, and resumed from the position a checkpoint saved (StreamPosition).

Every batch is a :class:`RawBatch` (images transformed, captions, bad-sample counts, stream positions) of this
rank's share of the global batch.
"""
from __future__ import annotations

import multiprocessing
from typing import Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset

from topoclip.data.batch import RawBatch, loader_generator
from topoclip.data.quality import DataQualityError
from topoclip.core.errors import ConfigError
from topoclip.preprocess.transforms import TrainingCrop
from topoclip.core.workers import loader_workers, settle_before_fork


def stream_batches(open_stream: Callable, config, start_step: int, rank: int, world_size: int, loader_options: dict,
                   *, tokenizer=None, pin_memory: bool = False, stream: Optional[dict] = None) -> Iterator[RawBatch]:
    """This rank's RawBatches of the stream `open_stream(data, ...)` opens (a DataSource's reader); continues at
    `stream` (a StreamPosition.state()) when given. `start_step` is a scene source's: a stream resumes by position."""
    data, train, vision = config.data, config.train, config.model.vision
    local_batch, workers = train.batch_size // world_size, loader_workers(train.num_workers)
    # Streams: each sample's crop is seeded from its place in the stream (see CsvDataset), not by the worker.
    generator = torch.Generator()
    transform = TrainingCrop(vision.image_size, scale=data.augment_scale, generator=generator)  # uint8: normalised
    # on the device (training.data.prefetch_to_device)
    resume = StreamPosition(workers, world_size, stream)
    dataset = open_stream(data, transform=transform, batch_size=local_batch, seed=train.seed, rank=rank,
                          world_size=world_size, crop_generator=generator)
    if tokenizer is not None:
        dataset = TokenizedBatches(dataset, tokenizer)
    dataset = SharedEpoch(dataset)
    # A worker that found no good sample (e.g. its only shard is unreadable) yields an empty batch that
    # only carries counts (and its position); the model cannot take it, so both ride on the next batch.
    epoch, resumed, first = resume.epoch, resume.workers, resume.next_share
    carried = RawBatch(torch.empty(0, 3, 0, 0), [], {})
    dataset.set_epoch(epoch, resumed, first)  # before the workers start: they copy it
    settle_before_fork()  # a loader of the caller's (an evaluation's) may just have shut down
    # One loader for every epoch, its workers kept (loader_options' persistent_workers): starting them again each
    # epoch stalled the step for seconds at every epoch's start (on a GPU node, a third of a run of 32-batch epochs).
    loader = DataLoader(dataset, batch_size=None, pin_memory=pin_memory, generator=loader_generator(train.seed, epoch, rank),
                        **loader_options)
    while True:
        dataset.set_epoch(epoch, resumed, first)
        produced, skipped = False, {}  # skipped: this epoch's bad samples (carried may hold the last epoch's too)
        for batch in worker_errors_as_user_errors(loader):
            for kind, count in batch.bad_samples.items():
                carried.bad_samples[kind] = carried.bad_samples.get(kind, 0) + count
                skipped[kind] = skipped.get(kind, 0) + count
            carried.positions += batch.positions
            if not len(batch):
                continue
            produced = True
            batch.bad_samples, batch.positions = carried.bad_samples, carried.positions
            carried = RawBatch(torch.empty(0, 3, 0, 0), [], {})
            yield batch
        if not produced and not resumed:  # (a resumed epoch may have had nothing left)
            raise DataQualityError(f"an epoch of {data.train_data} produced no usable sample (skipped: "
                                   f"{skipped or 'none'}); check data.train_data and the files it names")
        epoch, resumed, first = epoch + 1, None, 0


def worker_errors_as_user_errors(loader: DataLoader) -> Iterator[RawBatch]:
    """The loader's batches; a DataQualityError raised in a worker (which DataLoader re-raises with the
    worker's traceback in its message) becomes its own one-line message again."""
    try:
        yield from loader
    except DataQualityError as error:
        lines = [line for line in str(error).splitlines() if line.strip()]
        last = lines[-1] if lines else str(error)
        raise DataQualityError(last.split("DataQualityError: ", 1)[-1]) from None


class TokenizedBatches(IterableDataset):
    """A RawBatch stream whose captions are tokenized where each batch is made (in its DataLoader worker).

    Each batch's `text` is the TextBatch of its captions at the full context length (one shape for
    every batch: nothing for torch.compile to recompile); the main process only copies it.
    """

    def __init__(self, dataset: IterableDataset, tokenizer):
        self.dataset, self.tokenizer = dataset, tokenizer

    def set_epoch(self, epoch: int, resume: Optional[dict] = None, first: int = 0) -> None:
        self.dataset.set_epoch(epoch, resume, first)

    def __iter__(self) -> Iterator[RawBatch]:
        for batch in self.dataset:
            if len(batch):  # an empty batch only carries bad-sample counts
                batch.text = self.tokenizer(batch.captions)
            yield batch


class SharedEpoch(IterableDataset):
    """A stream whose epoch the main process sets and kept (persistent) workers read, as OpenCLIP's SharedEpoch.

    A worker holds the copy of the dataset it started with, so `set_epoch` in the main process reaches it only
    through memory they share: the epoch, in a shared tensor, read when each epoch's iteration starts in the worker.
    The epoch the workers started with keeps its `resume` and `first` (a resumed stream's); a later one starts at its
    beginning, from share 0 (DataLoader takes every new epoch's batches from worker 0 first).
    """

    def __init__(self, dataset: IterableDataset):
        self.dataset = dataset
        # multiprocessing's shared memory, unlinked as it is made (a tensor's, sent to a fork server's workers, is a
        # named file that a killed job leaves behind); no lock: one writer, and it writes between epochs
        self.shared = multiprocessing.RawValue("q", 0)
        self.started = None  # the epoch this copy's dataset was set to (a worker's: the one it started with)

    def set_epoch(self, epoch: int, resume: Optional[dict] = None, first: int = 0) -> None:
        if epoch != self.started:
            self.dataset.set_epoch(epoch, resume, first)
            self.started = epoch
        self.shared.value = epoch

    def __iter__(self) -> Iterator[RawBatch]:
        epoch = self.shared.value
        if epoch != self.started:  # a worker at a later epoch than it started with: from its beginning
            self.dataset.set_epoch(epoch)
            self.started = epoch
        yield from self.dataset


class StreamPosition:
    """Where this rank's user-data stream is: its epoch and, for each DataLoader worker, the (cursor, made) of
    the last of its batches the trainer consumed (RawBatch.positions). A checkpoint stores `state()`;
    `training_batches(..., stream=state)` continues each worker there: the same samples in the same order,
    with the same crops, as an uninterrupted run.

    Carried in the batches, not read from the workers: the workers run ahead of the trainer (prefetch),
    and this is what was trained on. Torchdata's StatefulDataLoader keeps the same bookkeeping, but its
    state for an iterable dataset is a count of items to re-yield and discard (decoding every skipped
    image); the datasets here skip by cursor without decoding, so the 20 lines below are all it needs.
    """

    def __init__(self, num_workers: int, world_size: int, state: Optional[dict] = None):
        self.num_workers, self.world_size = num_workers, world_size
        self.epoch, self.workers, self.last = 0, {}, -1  # last: the share of the last batch consumed
        if state:
            if (state["num_workers"], state["world_size"]) != (num_workers, world_size):
                raise ConfigError(
                    f"this run's data stream was split over {state['world_size']} process(es) x {state['num_workers']} "
                    f"DataLoader worker(s) (train.num_workers); resume it with the same (now {world_size} x "
                    f"{num_workers}) so it continues exactly where it stopped")
            self.epoch = int(state["epoch"])
            self.workers = {int(worker): (int(cursor), int(made)) for worker, (cursor, made) in state["workers"].items()}
            self.last = int(state["last"])

    @staticmethod
    def is_state(state) -> bool:
        """Whether `state` (read from a checkpoint) has the form `state()` gives: integers where it has them."""
        def integers(*values) -> bool:
            return all(isinstance(value, int) and not isinstance(value, bool) for value in values)

        return (isinstance(state, dict) and integers(*(state.get(key) for key in
                                                        ("epoch", "last", "num_workers", "world_size")))
                and isinstance(state.get("workers"), dict)
                and all(isinstance(worker, str) and worker.isdigit() and isinstance(value, list) and len(value) == 2
                        and integers(*value) for worker, value in state["workers"].items()))

    def advance(self, batch: RawBatch) -> None:
        for epoch, worker, cursor, made in batch.positions:
            if epoch != self.epoch:
                self.epoch, self.workers = epoch, {}
            self.workers[worker] = (cursor, made)
            self.last = worker

    @property
    def next_share(self) -> int:
        """The share DataLoader takes its next batch from (its workers take turns)."""
        return (self.last + 1) % max(self.num_workers, 1)

    def state(self) -> dict:
        return {"epoch": self.epoch, "workers": {str(w): list(v) for w, v in self.workers.items()}, "last": self.last,
                "num_workers": self.num_workers, "world_size": self.world_size}
