"""Training batches for the trainer: the built-in scenes (exactly resumable) or the user's CSV/shards.

Every source yields :class:`RawBatch` (images transformed, captions as text, bad-sample counts)
from a DataLoader with `batch_size=None`. Batches are this rank's share of the global batch.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from topoclip.config import Config
from topoclip.data.batch import RawBatch, derived_seed
from topoclip.data.scenes import SceneDataset
from topoclip.transforms import train_transform


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


def collate(samples: list) -> RawBatch:
    images, captions = zip(*samples)
    return RawBatch(torch.stack(images), list(captions), {})


def training_batches(config: Config, start_step: int, rank: int = 0, world_size: int = 1) -> Iterator[RawBatch]:
    """Endless iterator of this rank's RawBatches, starting at `start_step`."""
    data, train, vision = config.data, config.train, config.model.vision
    local_batch = train.batch_size // world_size
    workers = train.num_workers
    loader_options = dict(num_workers=workers, persistent_workers=workers > 0, prefetch_factor=4 if workers else None)
    if data.source == "scenes":
        # The crop RNG is reseeded per sample (see AugmentedScenes): the same in every worker layout.
        generator = torch.Generator()
        transform = train_transform(vision.image_size, vision.mean, vision.std, scale=data.augment_scale,
                                    generator=generator)
        scenes = SceneDataset(data.scenes, "train")
        sampler = StepBatchSampler(len(scenes), train.batch_size, train.seed, start_step, rank, world_size)
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
                             rank=rank, world_size=world_size)
    else:
        from topoclip.data.shards import ShardDataset

        dataset = ShardDataset(data.train_data, transform=transform, batch_size=local_batch,
                               weights=data.weights or None, resampled=data.resampled,
                               samples_per_epoch=data.samples_per_epoch or None, shuffle_buffer=data.shuffle_buffer,
                               seed=train.seed, drop_last=True, rank=rank, world_size=world_size)
    # Streams resume at the epoch they were in, not the exact sample (as OpenCLIP's).
    # A worker that found no good sample (e.g. its only shard is unreadable) yields an empty batch that
    # only carries counts; the model cannot take it, so its counts ride on the next batch instead.
    epoch = 0
    carried: dict[str, int] = {}
    while True:
        dataset.set_epoch(epoch)
        loader = DataLoader(dataset, batch_size=None, **{**loader_options, "persistent_workers": False})
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
