"""WebDataset tar shards as img2dataset writes them, read as RawBatches (writing: topoclip.data.shard_writer).

A shard is a tar of samples; the members of one sample share a key: `000000123.jpg` (or .png, .webp, ...),
`000000123.txt` (the caption) and optionally `000000123.json`. Reading goes through the `webdataset`
library (shard opening, tar iteration, grouping by key, shuffle buffer); decoding, skipping and counting
bad samples is done here, so nothing ever raises out of a DataLoader worker for one bad sample.

Shard specs: one string of brace patterns joined by "::" (each part is one source), e.g.
"a/{00000..00009}.tar::b/{0..3}.tar", or a list of such strings. With `weights` (one per source), shards
are drawn with replacement with probability proportional to their source's weight, like OpenCLIP's
`--train-data-upsampling-factors`: a source's share of the stream is weight x number of shards.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import random
import re
import warnings
from typing import Callable, Iterable, Iterator, Optional, Sequence, Union

import braceexpand
import numpy as np
import torch
import torch.utils.data
import webdataset as wds

from topoclip.data.batch import Outcome, RawBatch, assemble_batches, derived_seed, worker_position
from topoclip.data.images import IMAGE_EXTENSIONS, DecodeSettings, clean_caption, decode_for
from topoclip.data.quality import BadSample, DataQualityError
from topoclip.core.door import IMAGE_BYTES, open_regular

logger = logging.getLogger(__name__)


# Shards one spec may expand to: LAION-5B is about 230,000 shards, so real data sits far below; a brace
# pattern such as "{0..99999999}" would otherwise build a list of 10^8 strings (GBs) before anything is read.
MAX_SHARDS = 1_000_000


def expand_urls(spec: str) -> list[str]:
    """The URLs of one "::"-joined shard spec, expanded exactly as webdataset expands them (its
    `shardlists.expand_urls`: ${WDS_VAR} environment variables, then braces), at most MAX_SHARDS.

    ValueError (one line) for a missing ${WDS_VAR} variable or a spec that expands past MAX_SHARDS.
    """
    urls: list[str] = []
    for part in spec.split("::"):
        for _ in range(10):  # webdataset substitutes up to ten times, for variables that name variables
            last = part
            try:
                part = wds.shardlists.envsubst(part)
            except AssertionError:  # webdataset's way of saying a ${VAR} has no WDS_VAR in the environment
                raise ValueError(f"shard pattern {spec!r} names an environment variable ${{...}} that is not set "
                                 f"(webdataset reads ${{NAME}} as WDS_NAME)") from None
            if part == last:
                break
        urls.extend(itertools.islice(braceexpand.braceexpand(part), MAX_SHARDS + 1 - len(urls)))
        if len(urls) > MAX_SHARDS:
            raise ValueError(f"shard pattern {spec[:200]!r} expands to more than {MAX_SHARDS:,} shards; "
                             f"check its braces (e.g. 'data/{{00000..00999}}.tar')")
    return urls


def command_urls(specs: Union[str, Sequence[str]]) -> list[str]:
    """The expanded URLs of shard specs that webdataset would open through a command or the network: any
    scheme but file: (pipe:, http(s): and s3: run curl, aws or a shell), and "-" (stdin). Braces and
    ${WDS_VAR} are expanded first, so a command hidden inside braces is found like a plain one."""
    specs = [specs] if isinstance(specs, str) else list(specs)
    return [url for spec in specs for url in expand_urls(spec) if not is_local(url.strip())
            and not url.strip().lower().startswith("file:")]


def expand_shard_sources(
    urls: Union[str, Sequence[str]], weights: Optional[Sequence[float]] = None
) -> tuple[list[str], list[float]]:
    """Shard list and per-shard weights from "::"-joined brace patterns (or a list of them).

    Returns (shards (S,), weights (S,)): every shard of source i gets weights[i] (1.0 when not given).
    """
    specs = [urls] if isinstance(urls, str) else list(urls)
    sources = [part for spec in specs for part in spec.split("::") if part.strip()]
    if not sources:
        raise ValueError("no shards given: pass a brace pattern such as 'data/{00000..00009}.tar'")
    if weights is None:
        weights = [1.0] * len(sources)
    if len(weights) != len(sources):
        raise ValueError(
            f"got {len(weights)} weights for {len(sources)} shard sources {sources}; give one weight per "
            "source, in the order of the '::'-separated patterns"
        )
    if any(w < 0 for w in weights) or not any(w > 0 for w in weights):
        raise ValueError(f"source weights must be non-negative with at least one positive, got {list(weights)}")
    shards, shard_weights = [], []
    for source, weight in zip(sources, weights):
        expanded = expand_urls(source)
        shards.extend(expanded)
        shard_weights.extend([float(weight)] * len(expanded))
        if len(shards) > MAX_SHARDS:
            raise ValueError(f"the shard patterns expand to more than {MAX_SHARDS:,} shards; check their braces")
    return shards, shard_weights


def is_local(url: str) -> bool:
    """A plain file path (not a URL scheme such as https:, pipe:, file:, or '-' for stdin)."""
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", url) is None and url != "-"


def tar_samples(sources: Iterable[dict], handler: Callable[[BaseException], bool],
                select_files: Optional[Callable[[str], bool]] = None) -> Iterator[dict]:
    """webdataset's tarfile_to_samples, through topoclip's door: each local shard opened as a regular file (a FIFO or a
    device named like a shard is an unreadable shard, handed to `handler` and counted, never a read that blocks
    forever), and each member's declared size checked before it is read (a member past MEMBER_BYTES is handed to
    `handler` and skipped: a sparse tar of a few KB can declare gigabytes). A URL of another scheme is opened by
    webdataset's gopen as before (only a typed value gets here). Samples are grouped by webdataset's group_by_keys."""
    from webdataset.tariterators import group_by_keys

    return group_by_keys(_members(sources, handler, select_files), handler=handler)


# The largest member of a shard read into memory: an image as large as an encoded image may be (door.IMAGE_BYTES).
MEMBER_BYTES = IMAGE_BYTES
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's own metadata members, skipped as it skips them


def _members(sources: Iterable[dict], handler: Callable[[BaseException], bool],
             select_files: Optional[Callable[[str], bool]]) -> Iterator[dict]:
    """{"fname", "data", "__url__"} of every regular member of every shard, as webdataset's tar_file_expander gives
    them, with the door's checks (see tar_samples)."""
    import tarfile

    from webdataset import gopen

    for source in sources:
        url = source["url"]
        path = re.sub(r"^file:(//)?", "", url)  # webdataset's file: URLs are local files too
        try:
            stream = open_regular(path, "shard", limit=None, error=ShardRefused) if is_local(path) else gopen.gopen(url)
            archive = tarfile.open(fileobj=stream, mode="r|*")
        except Exception as error:
            error.args = error.args + (url,)
            if handler(error):
                continue
            break
        with stream:
            for info in _each(archive, url, handler):
                if not info.isreg() or _META.match(info.name) or (select_files and not select_files(info.name)):
                    continue
                try:
                    if info.size > MEMBER_BYTES:
                        raise ShardRefused(f"{url}: member {info.name[:80]} claims {info.size:,} bytes, over the "
                                           f"{MEMBER_BYTES:,} one member may be; skipped")
                    yield {"fname": info.name, "data": archive.extractfile(info).read(), "__url__": url}
                except Exception as error:
                    error.args = error.args + (url,)
                    if not handler(error):
                        return
                archive.members = []  # a stream's listing is not kept


def _each(archive, url: str, handler: Callable[[BaseException], bool]) -> Iterator:
    """The members of a tar read as a stream; a damaged header ends the shard through `handler`."""
    try:
        yield from archive
    except Exception as error:
        error.args = error.args + (url,)
        handler(error)


class ShardRefused(ValueError):
    """A local shard path that is not a regular file (see `tar_samples`)."""


# Shard errors with no readable sample in between after which reading stops (an endless resampled
# stream of unreadable shards would otherwise spin forever).
MAX_SHARD_ERRORS_IN_A_ROW = 100


class ShardDataset(torch.utils.data.IterableDataset):
    """Image-caption samples from WebDataset tar shards; yields RawBatch (use DataLoader(batch_size=None)).

    Without resampling, each epoch the shard list is shuffled from (seed, epoch), split over ranks
    (shard r, r + world_size, ...) and then over DataLoader workers; every shard is read once. With
    `resampled`, every worker draws shards with replacement (by weight) from its own seeded stream, and
    `samples_per_epoch` is required. `samples_per_epoch` fixes the epoch length (webdataset's `with_epoch`):
    each worker yields ceil(samples_per_epoch / (batch_size x world_size x workers)) batches, so an epoch
    holds at least samples_per_epoch samples across all ranks (fewer only if non-resampled data runs out).
    Samples pass through a shuffle buffer of `shuffle_buffer` samples (1 or 0: no shuffling).
    """

    def __init__(
        self,
        urls: Union[str, Sequence[str]],
        *,
        transform: Callable,
        batch_size: int,
        weights: Optional[Sequence[float]] = None,
        resampled: bool = False,
        samples_per_epoch: Optional[int] = None,
        shuffle_buffer: int = 1000,
        shuffle_initial: Optional[int] = None,
        shuffle_shards: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        decode: DecodeSettings = DecodeSettings(),
        image_extensions: Sequence[str] = IMAGE_EXTENSIONS,
        caption_extension: str = "txt",
        crop_generator: Optional[torch.Generator] = None,
    ):
        super().__init__()
        # As CsvDataset's: reseeded for every sample from (seed, epoch, rank, worker, position in its stream).
        self.crop_generator = crop_generator
        self.resume: dict[int, tuple[int, int]] = {}
        self.first = 0
        self.shards, self.shard_weights = expand_shard_sources(urls, weights)
        if weights is not None and not resampled:
            raise ValueError(
                "source weights need resampling (data.resampled = true): without it every shard is read "
                "exactly once per epoch and weights have no effect"
            )
        if resampled and samples_per_epoch is None:
            raise ValueError("resampled shards form an endless stream: set data.samples_per_epoch")
        missing = [url for url in self.shards if is_local(url) and not os.path.isfile(url)]
        if missing:
            raise FileNotFoundError(
                f"{len(missing)} of {len(self.shards)} shards do not exist, e.g. {missing[:3]}; check the "
                "brace pattern (for example 'data/{00000..00009}.tar') in data.train_data"
            )
        self.transform = transform
        self.batch_size = int(batch_size)
        self.resampled = resampled
        self.samples_per_epoch = samples_per_epoch
        self.shuffle_buffer = int(shuffle_buffer)
        self.shuffle_initial = self.shuffle_buffer if shuffle_initial is None else int(shuffle_initial)
        self.shuffle_shards = shuffle_shards
        self.seed = int(seed)
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.decode = decode
        self.image_extensions = tuple(ext.lower().lstrip(".") for ext in image_extensions)
        self.caption_extension = caption_extension.lower().lstrip(".")
        self.epoch = 0

    def set_epoch(self, epoch: int, resume: Optional[dict[int, tuple[int, int]]] = None, first: int = 0) -> None:
        """Select the shard order / resampling stream of `epoch` for the next iteration; `resume` and `first`
        as CsvDataset.set_epoch's.

        A resumed worker replays its stream up to the cursor without decoding an image: webdataset keeps
        no state to restore (the shuffle buffer's contents are samples read so far), so the same seeded
        shard order and buffer are run again and the first `cursor` outcomes dropped. That re-reads the
        tar bytes of this epoch up to the cursor (sequential reads, no decoding); torchdata's
        StatefulDataLoader would do the same for an iterable without state (it re-yields and discards
        decoded samples), so it is not used.
        """
        self.epoch = int(epoch)
        self.resume, self.first = dict(resume or {}), int(first)

    def batches_per_worker(self, num_workers: int = 1, world_size: int = 1) -> Optional[int]:
        """Batches one worker yields per epoch under samples_per_epoch (None: until the shards run out)."""
        if self.samples_per_epoch is None:
            return None
        return math.ceil(self.samples_per_epoch / (self.batch_size * world_size * num_workers))

    def _shard_stream(self, rank: int, world_size: int, worker: int, num_workers: int) -> Iterator[dict]:
        """dict(url=...) for each shard this worker reads, in order."""
        if self.resampled:
            rng = random.Random(derived_seed(self.seed, self.epoch, rank, worker))
            cumulative = list(np.cumsum(self.shard_weights))
            while True:
                yield dict(url=rng.choices(self.shards, cum_weights=cumulative)[0])
        order = list(self.shards)
        if self.shuffle_shards:
            random.Random(derived_seed(self.seed, self.epoch)).shuffle(order)  # same order on every rank
        mine = order[rank::world_size][worker::num_workers]
        if not mine:
            warnings.warn(
                f"rank {rank} worker {worker} gets no shard: {len(order)} shards for {world_size} ranks x "
                f"{num_workers} workers; use fewer DataLoader workers, more shards, or data.resampled = true"
            )
        for url in mine:
            yield dict(url=url)

    def load(self, sample: dict) -> Outcome:
        """(image tensor from the transform, caption, key) for one grouped tar sample, or its BadSample."""
        try:
            image_key = next((ext for ext in self.image_extensions if ext in sample), None)
            if image_key is None or self.caption_extension not in sample:
                members = sorted(key for key in sample if not key.startswith("__"))
                raise BadSample(
                    "unpaired_member", f"{sample.get('__url__')}: key {sample.get('__key__')} has only {members}"
                )
            caption = clean_caption(sample[self.caption_extension])
            pixels = decode_for(self.transform, sample[image_key], self.decode)
        except BadSample as bad:
            logger.debug("skipped %s: %s", sample.get("__key__"), bad)
            return bad
        return pixels, caption, f"{sample.get('__url__')}/{sample.get('__key__')}"

    def __iter__(self) -> Iterator[RawBatch]:
        rank, world_size, worker, num_workers = worker_position(self.rank, self.world_size, self.first)
        shard_errors: list[BaseException] = []
        reads = counted_read = 0  # shards handed to webdataset so far; the read whose error was counted

        def shard_stream() -> Iterator[dict]:
            nonlocal reads
            for source in self._shard_stream(rank, world_size, worker, num_workers):
                reads += 1  # webdataset pulls the next shard only once it is done with this one
                yield source

        def count_and_continue(error: BaseException) -> bool:
            # webdataset's handler for a shard that cannot be opened or read, or a duplicate member name.
            # One failing read is one corrupt shard: a member cut short by truncation reaches this handler
            # twice (from reading the member, then from the tar stream failing on its next header).
            nonlocal counted_read
            logger.debug("shard error: %s", error)
            if counted_read == reads:
                return True
            counted_read = reads
            shard_errors.append(error)
            if len(shard_errors) >= MAX_SHARD_ERRORS_IN_A_ROW:  # no sample in between: never ends otherwise
                raise DataQualityError(
                    f"{len(shard_errors)} shard errors in a row without one readable sample (rank {rank}, "
                    f"worker {worker}); the first: {shard_errors[0]}. Check the shards in data.train_data."
                )
            return True

        samples: Iterable[dict] = tar_samples(shard_stream(), count_and_continue)
        if self.shuffle_buffer > 1:
            rng = random.Random(derived_seed(self.seed, self.epoch, rank, worker, 1))
            samples = wds.shuffle(self.shuffle_buffer, self.shuffle_initial, rng=rng)(samples)

        def undecoded() -> Iterator[Union[dict, BadSample]]:
            for sample in samples:
                while shard_errors:
                    yield BadSample("corrupt_shard", str(shard_errors.pop()))
                yield sample
            while shard_errors:
                yield BadSample("corrupt_shard", str(shard_errors.pop()))

        cursor, made = self.resume.get(worker, (0, 0))

        def outcomes() -> Iterator[Outcome]:
            for position, item in enumerate(undecoded()):
                if position < cursor:  # consumed before the resume: replayed, not decoded
                    continue
                if isinstance(item, BadSample):
                    yield item
                    continue
                if self.crop_generator is not None:
                    self.crop_generator.manual_seed(derived_seed(self.seed, self.epoch, rank, worker, position))
                yield self.load(item)

        max_batches = self.batches_per_worker(num_workers, world_size)
        if max_batches is not None:
            max_batches -= made
        return assemble_batches(outcomes(), self.batch_size, drop_last=self.drop_last, max_batches=max_batches,
                                epoch=self.epoch, worker=worker, start=(cursor, made))


def read_captions(urls: Union[str, Sequence[str]], limit: int) -> list[str]:
    """Up to `limit` clean captions from the shards in listed order (only .txt members are read; bad skipped).

    For fitting a tokenizer's vocabulary: the captions come from the first shards, not a random sample.
    """
    shards, _ = expand_shard_sources(urls)
    captions: list[str] = []
    if limit <= 0:
        return captions
    samples = tar_samples((dict(url=url) for url in shards), wds.ignore_and_continue,
                          select_files=lambda name: name.endswith(".txt"))
    for sample in samples:
        try:
            captions.append(clean_caption(sample.get("txt")))
        except BadSample:
            continue
        if len(captions) >= limit:
            break
    return captions
