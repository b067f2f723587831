"""Training batches for the trainer: its data source's (the registry in topoclip.data.sources) for this rank,
and their copy to the GPU one step ahead.

Every source yields :class:`RawBatch` (images transformed, captions as text, bad-sample counts).
Batches are this rank's share of the global batch.
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence

import dataclasses

import torch

from topoclip.config import Config
from topoclip.data.batch import RawBatch
from topoclip.data.sources import get_source
from topoclip.preprocess.transforms import OPENAI_MEAN, OPENAI_STD, device_pixels
from topoclip.core.workers import loader_workers, worker_options

# Batches queued per rank by the loader's workers, whatever their number (each is a whole local batch: 1.2 GB for
# 2,048 images of 224 px in fp32): 2 workers prefetch 4 each, 8 workers 1 each. More workers read faster without
# holding more memory.
LOADER_BATCHES_IN_FLIGHT = 8


def prefetch_factor(workers: int) -> int:
    """Batches each of `workers` DataLoader workers queues: LOADER_BATCHES_IN_FLIGHT shared among them."""
    return max(1, -(-LOADER_BATCHES_IN_FLIGHT // workers))


def training_batches(config: Config, start_step: int, rank: int = 0, world_size: int = 1, *, tokenizer=None,
                     pin_memory: bool = False, stream: Optional[dict] = None) -> Iterator[RawBatch]:
    """Endless iterator of this rank's RawBatches, starting at `start_step`.

    tokenizer: given, the user-data (CSV/shard) batches arrive tokenized by the loader workers (`text`).
    pin_memory: those batches arrive in page-locked memory (for non-blocking copies to a GPU).
    stream: a user-data stream's StreamPosition.state() of this rank, saved at `start_step`: continue there.
    """
    workers = loader_workers(config.train.num_workers)
    loader_options = dict(**worker_options(workers), persistent_workers=workers > 0,
                          prefetch_factor=prefetch_factor(workers) if workers else None)
    return get_source(config.data.source).batches(config, start_step, rank, world_size, loader_options,
                                                  tokenizer=tokenizer, pin_memory=pin_memory, stream=stream)


def prefetch_to_device(batches: Iterator[RawBatch], device: torch.device, mean: Sequence[float] = OPENAI_MEAN,
                       std: Sequence[float] = OPENAI_STD) -> Iterator[RawBatch]:
    """The same batches with images (and tokens, when the workers made them) on `device`, a user stream's uint8
    pixels normalised there (`device_pixels`, with the model's pixel statistics `mean` and `std`).

    On CUDA each batch is copied one step ahead on a side stream, and normalised there, so the copy (≈ 40 MB a step
    for 256 uint8 images at 224 px) and the conversion overlap the previous step's compute instead of queueing
    before the next; from pinned memory the host does not wait for it either. Elsewhere the conversion happens as
    each batch is taken.
    """
    if device.type != "cuda":
        for batch in batches:
            yield dataclasses.replace(batch, images=device_pixels(batch.images, mean, std))
        return
    side = torch.cuda.Stream(device)

    def send(batch: RawBatch):
        with torch.cuda.stream(side):
            moved = dataclasses.replace(batch, images=device_pixels(batch.images.to(device, non_blocking=True), mean, std),
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
