"""The built-in scenes' training batches: a function of the step, so a run resumes exactly without a position.

The scenes are rendered once into memory (uint8, 3 KB an image at 32 px) by DataLoader workers, then every
step is a tensor index plus one batched crop-and-resize in the main process. On 2 CPU cores rendering
(~0.3 ms) and a per-image PIL crop (~0.3 ms) cost about a quarter of a small model's step; rendering once and
cropping in batch leaves both cores to the model. A split larger than SCENES_IN_MEMORY_BYTES is rendered on
the fly by the workers instead.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from topoclip.data.batch import RawBatch, derived_seed, loader_generator
from topoclip.data.scenes import SceneDataset
from topoclip.preprocess.transforms import RandomResizedCrop, resized_crops, train_transform
from topoclip.core.workers import loader_workers, worker_options

# The largest training split kept in memory as uint8 pixels; larger ones are rendered every step.
SCENES_IN_MEMORY_BYTES = 2 * 1024**3


def scene_batches(config, start_step: int, rank: int, world_size: int, loader_options: dict, *, tokenizer=None,
                  pin_memory: bool = False, stream: Optional[dict] = None) -> Iterator[RawBatch]:
    """This rank's RawBatches of the built-in scenes from `start_step` on. The keywords are a stream's and do not
    apply: a scene batch carries its captions as text (the trainer tokenizes them), sits in memory already and is
    found again from the step."""
    data, train, vision = config.data, config.train, config.model.vision
    workers = loader_workers(train.num_workers)
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
    yield from DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, generator=loader_generator(train.seed, rank),
                          **loader_options)


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
        # (rendering draws nothing at random: any fixed generator keeps the global RNG out of it)
        loader = DataLoader(chunks, batch_size=None, collate_fn=scenes.batch, generator=loader_generator(0),
                            **worker_options(min(workers, len(chunks))))
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
