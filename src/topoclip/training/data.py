"""Training batches for the trainer: the built-in scenes (exactly resumable) or the user's CSV/shards.

Every source yields :class:`RawBatch` (images transformed, captions as text, bad-sample counts).
Batches are this rank's share of the global batch.

The built-in scenes are rendered once into memory (uint8, 3 KB an image at 32 px) by DataLoader
workers, then every step is a tensor index plus one batched crop-and-resize in the main process.
On 2 CPU cores rendering (~0.3 ms) and a per-image PIL crop (~0.3 ms) cost about a quarter of a
small model's step; rendering once and cropping in batch leaves both cores to the model. A split
larger than SCENES_IN_MEMORY_BYTES is rendered on the fly by the workers instead.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from topoclip.config import Config, ConfigError
from topoclip.data.batch import RawBatch, derived_seed
from topoclip.data.quality import DataQualityError
from topoclip.data.scenes import SceneDataset
from topoclip.data.sources import get_source
from topoclip.transforms import RandomResizedCrop, resized_crops, train_transform
from topoclip.workers import start_worker

# The largest training split kept in memory as uint8 pixels; larger ones are rendered every step.
SCENES_IN_MEMORY_BYTES = 2 * 1024**3


class StepBatchSampler(Sampler):
    """Index batches as a pure function of the step: resuming at step s reproduces the same stream.

    Epoch e visits a permutation seeded by (seed, e); step s takes global batch s mod steps_per_epoch
    of it; rank r takes rows [r·b, (r+1)·b) of that global batch. Items are (epoch, index) pairs so the
    dataset can seed each sample's augmentation.
    """

    def __init__(self, size: int, global_batch: int, seed: int, start_step: int = 0, rank: int = 0, world_size: int = 1):
        if global_batch > size:
            raise ValueError(f"train.batch_size={global_batch} is larger than the training set ({size} samples); "
                             f"lower train.batch_size or enlarge the data (data.scenes.train_size)")
        self.size, self.global_batch, self.seed = size, global_batch, seed
        self.start_step, self.rank, self.local_batch = start_step, rank, global_batch // world_size
        self.steps_per_epoch = size // global_batch  # the remainder of each epoch is dropped

    def indices(self, steps: int) -> torch.Tensor:
        """Sorted unique sample indices this rank reads in its next `steps` steps."""
        if steps * self.global_batch >= self.size * 2:  # (almost) every sample; a superset costs only rendering
            return torch.arange(self.size)
        batches = iter(self)
        return torch.tensor(sorted({index for _ in range(steps) for _, index in next(batches)}), dtype=torch.long)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        step = self.start_step
        order, order_epoch = None, -1
        while True:
            epoch, within = divmod(step, self.steps_per_epoch)
            if epoch != order_epoch:
                generator = torch.Generator().manual_seed(derived_seed(self.seed, epoch))
                order, order_epoch = torch.randperm(self.size, generator=generator), epoch
            start = within * self.global_batch + self.rank * self.local_batch
            yield [(epoch, int(i)) for i in order[start : start + self.local_batch]]
            step += 1


class AugmentedScenes(Dataset):
    """(epoch, index) -> (augmented image (3, S, S), caption); the crop is seeded by (seed, epoch, index)."""

    def __init__(self, scenes: SceneDataset, transform, generator: torch.Generator, seed: int):
        self.scenes, self.transform, self.generator, self.seed = scenes, transform, generator, seed

    def __len__(self) -> int:
        return len(self.scenes)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        self.generator.manual_seed(derived_seed(self.seed, epoch, index))
        image, caption = self.scenes[index]
        return self.transform(image), caption


class RenderedScenes:
    """The samples `indices` of a scenes split, rendered once into memory by `workers` DataLoader workers.

    images: (K, 3, S, S) uint8 and captions (K,) for the K indices; `row[i]` is sample i's row (-1: absent).
    """

    def __init__(self, scenes: SceneDataset, indices: torch.Tensor, workers: int, chunk: int = 500):
        chunks = [indices[start : start + chunk].tolist() for start in range(0, len(indices), chunk)]
        loader = DataLoader(chunks, batch_size=None, num_workers=min(workers, len(chunks)), collate_fn=scenes.batch,
                            worker_init_fn=start_worker if workers else None)
        images, self.captions = [], []
        for pixels, captions in loader:  # (chunk, S, S, 3) uint8, chunk captions
            images.append(torch.from_numpy(pixels).permute(0, 3, 1, 2))
            self.captions += captions
        self.images = torch.cat(images)  # (K, 3, S, S) uint8
        self.row = torch.full((len(scenes),), -1, dtype=torch.long)
        self.row[indices] = torch.arange(len(indices))

    def batches(self, sampler: "StepBatchSampler", vision, scale: tuple[float, float], seed: int) -> Iterator[RawBatch]:
        """RawBatches in `sampler`'s order; each crop box is seeded by (seed, epoch, index), as in AugmentedScenes."""
        size = self.images.shape[-1]
        generator = torch.Generator()
        crop = RandomResizedCrop(vision.image_size, scale=scale, generator=generator)
        for keys in sampler:
            boxes = []
            for epoch, index in keys:
                generator.manual_seed(derived_seed(seed, epoch, index))
                boxes.append(crop.get_params(size, size))
            rows = self.row[torch.tensor([index for _, index in keys])]
            images = resized_crops(self.images[rows], torch.tensor(boxes), vision.image_size, vision.mean, vision.std)
            yield RawBatch(images, [self.captions[i] for i in rows.tolist()], {})


def collate(samples: list) -> RawBatch:
    images, captions = zip(*samples)
    return RawBatch(torch.stack(images), list(captions), {})


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


def training_batches(config: Config, start_step: int, rank: int = 0, world_size: int = 1, *, tokenizer=None,
                     pin_memory: bool = False, stream: Optional[dict] = None) -> Iterator[RawBatch]:
    """Endless iterator of this rank's RawBatches, starting at `start_step`.

    tokenizer: given, the user-data (CSV/shard) batches arrive tokenized by the loader workers (`text`).
    pin_memory: those batches arrive in page-locked memory (for non-blocking copies to a GPU).
    stream: a user-data stream's StreamPosition.state() of this rank, saved at `start_step`: continue there.
    """
    data, train, vision = config.data, config.train, config.model.vision
    local_batch = train.batch_size // world_size
    workers = train.num_workers
    loader_options = dict(num_workers=workers, persistent_workers=workers > 0, prefetch_factor=4 if workers else None,
                          worker_init_fn=start_worker if workers else None)
    source = get_source(data.source)
    if not source.stream:  # the built-in scenes: indexed by the step, exactly resumable
        scenes = SceneDataset(data.scenes, "train")
        sampler = StepBatchSampler(len(scenes), train.batch_size, train.seed, start_step, rank, world_size)
        if len(scenes) * 3 * data.scenes.image_size**2 <= SCENES_IN_MEMORY_BYTES:
            rendered = RenderedScenes(scenes, sampler.indices(train.steps - start_step), workers)
            yield from rendered.batches(sampler, vision, data.augment_scale, train.seed)
            return
        # The crop RNG is reseeded per sample (see AugmentedScenes): the same in every worker layout.
        generator = torch.Generator()
        transform = train_transform(vision.image_size, vision.mean, vision.std, scale=data.augment_scale,
                                    generator=generator)
        dataset = AugmentedScenes(scenes, transform, generator, train.seed)
        yield from DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, **loader_options)
        return
    # Streams: each sample's crop is seeded from its place in the stream (see CsvDataset), not by the worker.
    generator = torch.Generator()
    transform = train_transform(vision.image_size, vision.mean, vision.std, scale=data.augment_scale,
                                generator=generator)
    resume = StreamPosition(workers, world_size, stream)
    dataset = source.open(data, transform=transform, batch_size=local_batch, seed=train.seed, rank=rank,
                          world_size=world_size, crop_generator=generator)
    if tokenizer is not None:
        dataset = TokenizedBatches(dataset, tokenizer)
    # A worker that found no good sample (e.g. its only shard is unreadable) yields an empty batch that
    # only carries counts (and its position); the model cannot take it, so both ride on the next batch.
    epoch, resumed, first = resume.epoch, resume.workers, resume.next_share
    carried = RawBatch(torch.empty(0, 3, 0, 0), [], {})
    while True:
        dataset.set_epoch(epoch, resumed, first)
        loader = DataLoader(dataset, batch_size=None, pin_memory=pin_memory,
                            **{**loader_options, "persistent_workers": False})
        produced = False
        for batch in worker_errors_as_user_errors(loader):
            for kind, count in batch.bad_samples.items():
                carried.bad_samples[kind] = carried.bad_samples.get(kind, 0) + count
            carried.positions += batch.positions
            if not len(batch):
                continue
            produced = True
            batch.bad_samples, batch.positions = carried.bad_samples, carried.positions
            carried = RawBatch(torch.empty(0, 3, 0, 0), [], {})
            yield batch
        if not produced and not resumed:  # (a resumed epoch may have had nothing left)
            raise DataQualityError(f"an epoch of {data.train_data} produced no usable sample (skipped: "
                                   f"{carried.bad_samples or 'none'}); check data.train_data and the files it names")
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


def prefetch_to_device(batches: Iterator[RawBatch], device: torch.device) -> Iterator[RawBatch]:
    """The same batches with images (and tokens, when the workers made them) already on `device`.

    On CUDA each batch is copied one step ahead on a side stream, so the copy (≈ 150 MB a step for
    256 images at 224 px in fp32) overlaps the previous step's compute instead of queueing before
    the next; from pinned memory the host does not wait for it either. Elsewhere a pass-through.
    """
    if device.type != "cuda":
        yield from batches
        return
    side = torch.cuda.Stream(device)

    def send(batch: RawBatch):
        with torch.cuda.stream(side):
            moved = dataclasses.replace(batch, images=batch.images.to(device, non_blocking=True),
                                        text=None if batch.text is None else batch.text.to(device, non_blocking=True))
            copied = torch.cuda.Event()
            copied.record(side)
        return moved, copied

    def deliver(sent) -> RawBatch:
        moved, copied = sent
        compute = torch.cuda.current_stream(device)
        compute.wait_event(copied)
        for tensor in (moved.images,) + (() if moved.text is None else (moved.text.input_ids, moved.text.attention_mask)):
            tensor.record_stream(compute)  # memory made on the side stream, used on the compute stream
        return moved

    first = next(batches, None)
    if first is None:
        return
    ahead = send(first)
    for batch in batches:
        following = send(batch)  # queued on the side stream before this step's compute is
        yield deliver(ahead)
        ahead = following
    yield deliver(ahead)
