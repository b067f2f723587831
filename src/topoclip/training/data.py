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
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from topoclip.config import Config
from topoclip.data.batch import RawBatch, derived_seed
from topoclip.data.scenes import SceneDataset
from topoclip.transforms import RandomResizedCrop, resized_crops, train_transform

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
        loader = DataLoader(chunks, batch_size=None, num_workers=min(workers, len(chunks)), collate_fn=scenes.batch)
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

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[RawBatch]:
        for batch in self.dataset:
            if len(batch):  # an empty batch only carries bad-sample counts
                batch.text = self.tokenizer(batch.captions)
            yield batch


def training_batches(config: Config, start_step: int, rank: int = 0, world_size: int = 1, *, tokenizer=None,
                     pin_memory: bool = False) -> Iterator[RawBatch]:
    """Endless iterator of this rank's RawBatches, starting at `start_step`.

    tokenizer: given, the user-data (CSV/shard) batches arrive tokenized by the loader workers (`text`).
    pin_memory: those batches arrive in page-locked memory (for non-blocking copies to a GPU).
    """
    data, train, vision = config.data, config.train, config.model.vision
    local_batch = train.batch_size // world_size
    workers = train.num_workers
    loader_options = dict(num_workers=workers, persistent_workers=workers > 0, prefetch_factor=4 if workers else None)
    if data.source == "scenes":
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
    # Streams: crops from the global RNG, which DataLoader seeds differently in each worker.
    transform = train_transform(vision.image_size, vision.mean, vision.std, scale=data.augment_scale)
    if data.source == "csv":
        from topoclip.data.csv import CsvDataset

        dataset = CsvDataset(data.train_data, transform=transform, batch_size=local_batch,
                             image_key=data.csv_image_key, caption_key=data.csv_caption_key,
                             separator=data.csv_separator or None, seed=train.seed, drop_last=True,
                             rank=rank, world_size=world_size, allow_outside_paths=data.csv_allow_outside_paths)
    else:
        from topoclip.data.shards import ShardDataset

        dataset = ShardDataset(data.train_data, transform=transform, batch_size=local_batch,
                               weights=data.weights or None, resampled=data.resampled,
                               samples_per_epoch=data.samples_per_epoch or None, shuffle_buffer=data.shuffle_buffer,
                               seed=train.seed, drop_last=True, rank=rank, world_size=world_size)
    if tokenizer is not None:
        dataset = TokenizedBatches(dataset, tokenizer)
    # Streams resume at the epoch they were in, not the exact sample (as OpenCLIP's).
    # A worker that found no good sample (e.g. its only shard is unreadable) yields an empty batch that
    # only carries counts; the model cannot take it, so its counts ride on the next batch instead.
    epoch = 0
    carried: dict[str, int] = {}
    while True:
        dataset.set_epoch(epoch)
        loader = DataLoader(dataset, batch_size=None, pin_memory=pin_memory,
                            **{**loader_options, "persistent_workers": False})
        produced = False
        for batch in loader:
            if not len(batch):
                for kind, count in batch.bad_samples.items():
                    carried[kind] = carried.get(kind, 0) + count
                continue
            produced = True
            if carried:
                for kind, count in batch.bad_samples.items():
                    carried[kind] = carried.get(kind, 0) + count
                batch.bad_samples, carried = carried, {}
            yield batch
        if not produced:
            raise RuntimeError(f"an epoch of {data.train_data} produced no usable sample; check data.train_data "
                               f"and the bad-sample counts")
        epoch += 1


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
