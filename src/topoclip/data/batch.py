"""The batches user-data loaders yield, and how one DataLoader worker assembles them.

A loader is an IterableDataset that yields whole `RawBatch`es (use `DataLoader(dataset, batch_size=None)`).
Each batch carries the bad samples its worker skipped since its previous batch, so the main process gets
exact totals by summing `batch.bad_samples` over all batches from all workers (`counter += batch`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Iterable, Iterator, Optional, Union

import numpy as np
import torch
import torch.distributed
import torch.utils.data

from topoclip.data.quality import BadSample

if TYPE_CHECKING:
    from topoclip.preprocess.tokenizer import TextBatch


def derived_seed(*parts: int) -> int:
    """A 64-bit seed from several integers (seed, epoch, rank, worker, index), the same in every process."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0])


def loader_generator(*parts: int) -> torch.Generator:
    """A DataLoader's own generator, seeded from `parts` (the run's seed, the epoch, the rank): a loader draws its
    workers' base seed when it is iterated, from torch's global RNG without one. A resumed run restores that RNG
    from its checkpoint and then makes its loader, so the draw would shift every later use of it (LoRA's dropout)
    against the uninterrupted run."""
    return torch.Generator().manual_seed(derived_seed(*parts) % 2**63)


@dataclass
class RawBatch:
    """B image-caption pairs, images already transformed, captions still text."""

    images: torch.Tensor  # (B, 3, H, W) float; (0, 3, 0, 0) for a batch that only carries counts
    captions: list[str]  # B captions
    bad_samples: dict[str, int] = field(default_factory=dict)  # kind -> samples skipped since the last batch
    text: Optional[TextBatch] = None  # the captions tokenized, when the loader worker did it
    keys: list[str] = field(default_factory=list)  # B sample keys (CSV: "row N"; shards: "URL/KEY"), when known
    # [(epoch, worker, cursor, made)] of a user-data stream: the worker had consumed `cursor` samples of
    # its share of that epoch (good and bad) and made `made` batches when this one was complete; a worker
    # resumed there continues the stream exactly. (More than one when empty batches' counts ride on this.)
    positions: list[tuple[int, int, int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.captions)

    def pin_memory(self) -> "RawBatch":
        """Page-locked copy, so a DataLoader with pin_memory=True hands it over for a non-blocking copy."""
        return replace(self, images=self.images.pin_memory(),
                       text=None if self.text is None else self.text.pin_memory())


# What a loader's per-sample step produces: a usable (image, caption, key), or the reason it was skipped.
Outcome = Union[tuple[torch.Tensor, str, str], BadSample]


def stack_images(images: list[torch.Tensor]) -> torch.Tensor:
    """(B, 3, H, W) of B images; in a DataLoader worker, made in shared memory at once, so that sending the batch to
    the main process moves its handle instead of copying its bytes into shared memory a second time."""
    if torch.utils.data.get_worker_info() is None:
        return torch.stack(images)
    out = torch.empty((len(images), *images[0].shape), dtype=images[0].dtype).share_memory_()
    return torch.stack(images, out=out)


def assemble_batches(
    outcomes: Iterable[Outcome],
    batch_size: int,
    drop_last: bool = False,
    max_batches: Optional[int] = None,
    epoch: int = 0,
    worker: int = 0,
    start: tuple[int, int] = (0, 0),
) -> Iterator[RawBatch]:
    """Group per-sample outcomes into RawBatches of `batch_size`, counting skipped samples.

    Each batch's `positions` is [(epoch, worker, cursor, made)], counted on from `start` = (cursor, made) of a
    resumed worker: the outcomes consumed up to its last sample (the final batch: up to the end of the
    stream, whose trailing bad samples it carries) and the batches made so far, itself included.

    One full batch is held back until the next is ready, so bad samples found after the last batch still
    ride on it; nothing is lost. A worker that found no good sample at all yields one empty batch carrying
    its counts. `max_batches` stops after that many batches (a fixed epoch length on an endless stream);
    `drop_last` drops a final partial batch (its samples are good, so they are not counted as bad).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if max_batches is not None and max_batches <= 0:
        return
    images: list[torch.Tensor] = []
    captions: list[str] = []
    keys: list[str] = []
    pending: dict[str, int] = {}
    held: Optional[RawBatch] = None
    cursor, made = start
    emitted = 0
    for outcome in outcomes:
        cursor += 1
        if isinstance(outcome, BadSample):
            pending[outcome.kind] = pending.get(outcome.kind, 0) + 1
            continue
        image, caption, key = outcome
        images.append(image)
        captions.append(caption)
        keys.append(key)
        if len(captions) < batch_size:
            continue
        if held is not None:
            yield held
            emitted += 1
        made += 1
        held = RawBatch(stack_images(images), captions, pending, keys=keys, positions=[(epoch, worker, cursor, made)])
        images, captions, keys, pending = [], [], [], {}
        if max_batches is not None and emitted + 1 >= max_batches:
            break
    if captions and not drop_last:
        if held is not None:
            yield held
        made += 1
        held = RawBatch(stack_images(images), captions, pending, keys=keys, positions=[(epoch, worker, cursor, made)])
        pending = {}
    if held is not None:
        for kind, count in pending.items():
            held.bad_samples[kind] = held.bad_samples.get(kind, 0) + count
        held.positions = [(epoch, worker, cursor, held.positions[0][3])]
        yield held
    elif pending:
        yield RawBatch(torch.empty(0, 3, 0, 0), [], pending, positions=[(epoch, worker, cursor, made)])


def worker_position(rank: Optional[int] = None, world_size: Optional[int] = None,
                    first: int = 0) -> tuple[int, int, int, int]:
    """(rank, world_size, worker, num_workers) of the calling process.

    rank / world_size default to torch.distributed's when it is initialised, else (0, 1); worker and
    num_workers come from the DataLoader worker this runs in, else (0, 1). `worker` is the share of the
    data this worker reads: DataLoader worker w reads share (w + first) mod num_workers. DataLoader
    takes batches from its workers in turn starting with worker 0, so a resumed stream whose share
    `first` was due next sets it to continue in the same turn.
    """
    if rank is None or world_size is None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank() if rank is None else rank
            world_size = torch.distributed.get_world_size() if world_size is None else world_size
        else:
            rank = 0 if rank is None else rank
            world_size = 1 if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, world_size); got rank {rank}, world_size {world_size}")
    info = torch.utils.data.get_worker_info()
    worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
    return rank, world_size, (worker + first) % num_workers, num_workers
