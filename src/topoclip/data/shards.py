"""WebDataset tar shards as img2dataset writes them: read them as RawBatches, write them from samples.

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

import dataclasses
import io
import json
import logging
import math
import os
import random
import re
import tarfile
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy as np
import torch
import torch.utils.data
import webdataset as wds
from PIL import Image

from topoclip.data.batch import Outcome, RawBatch, assemble_batches, derived_seed, worker_position
from topoclip.data.csv import read_caption_table
from topoclip.data.images import IMAGE_EXTENSIONS, DecodeSettings, clean_caption, decode_image, resolve_image_path
from topoclip.data.quality import BadSample, BadSampleCounter, DataQualityError

logger = logging.getLogger(__name__)


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
        expanded = wds.shardlists.expand_urls(source)  # brace expansion (and WDS_ environment variables)
        shards.extend(expanded)
        shard_weights.extend([float(weight)] * len(expanded))
    return shards, shard_weights


def _is_local(url: str) -> bool:
    """A plain file path (not a URL scheme such as https:, pipe:, file:, or '-' for stdin)."""
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", url) is None and url != "-"


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
        missing = [url for url in self.shards if _is_local(url) and not os.path.isfile(url)]
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
            image = decode_image(sample[image_key], **dataclasses.asdict(self.decode))
        except BadSample as bad:
            logger.debug("skipped %s: %s", sample.get("__key__"), bad)
            return bad
        return self.transform(image), caption, f"{sample.get('__url__')}/{sample.get('__key__')}"

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

        samples: Iterable[dict] = wds.tarfile_to_samples(handler=count_and_continue)(shard_stream())
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
    samples = wds.tarfile_to_samples(handler=wds.ignore_and_continue, select_files=lambda name: name.endswith(".txt"))(
        dict(url=url) for url in shards
    )
    for sample in samples:
        try:
            captions.append(clean_caption(sample.get("txt")))
        except BadSample:
            continue
        if len(captions) >= limit:
            break
    return captions


# ----------------------------------------------------------------------------------------------------
# Writing shards


_MAGIC = ((b"\xff\xd8\xff", "jpg"), (b"\x89PNG\r\n\x1a\n", "png"), (b"GIF8", "gif"), (b"BM", "bmp"))
_SAVE_FORMATS = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}


def _sniff_extension(data: bytes) -> Optional[str]:
    """File extension of encoded image bytes from their magic number, or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return next((ext for magic, ext in _MAGIC if data.startswith(magic)), None)


def _encode(image: Image.Image, image_format: str, quality: int) -> bytes:
    buffer = io.BytesIO()
    options = {"quality": quality} if _SAVE_FORMATS[image_format] in ("JPEG", "WEBP") else {}
    image.save(buffer, format=_SAVE_FORMATS[image_format], **options)
    return buffer.getvalue()


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o444
    info.mtime = 0  # byte-identical shards for identical samples
    tar.addfile(info, io.BytesIO(data))


def write_shards(
    samples: Iterable[tuple],
    out_dir: Union[str, Path],
    samples_per_shard: int = 1000,
    image_format: str = "jpg",
    quality: int = 95,
) -> list[Path]:
    """Write (image, caption) or (image, caption, json dict) samples as img2dataset-style tar shards.

    image: uint8 array (H, W, 3) / (H, W), PIL image (encoded as `image_format`: jpg, png or webp) or
    encoded bytes (written unchanged, extension from the magic number, else `image_format`).
    caption: str (written as UTF-8) or bytes (unchanged). Shards are `out_dir/00000.tar`, `00001.tar`, ...;
    keys are the shard number (5 digits) + the index in the shard, as img2dataset writes them. Each shard
    is written to a temporary name and renamed when complete. Returns the shard paths in order.
    """
    image_format = image_format.lower().lstrip(".")
    if image_format not in _SAVE_FORMATS:
        raise ValueError(f"image_format must be one of {sorted(_SAVE_FORMATS)}, got {image_format!r}")
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be at least 1, got {samples_per_shard}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    index_digits = len(str(samples_per_shard - 1))
    paths: list[Path] = []
    tar: Optional[tarfile.TarFile] = None
    temporary: Optional[Path] = None
    try:
        for count, sample in enumerate(samples):
            shard, index = divmod(count, samples_per_shard)
            if index == 0:
                if tar is not None:
                    tar.close()
                    os.replace(temporary, paths[-1])
                paths.append(out_dir / f"{shard:05d}.tar")
                temporary = paths[-1].with_name(paths[-1].name + ".partial")
                tar = tarfile.open(temporary, "w", format=tarfile.GNU_FORMAT)
            image, caption, metadata = (tuple(sample) + (None,))[:3]
            key = f"{shard:05d}{index:0{index_digits}d}"
            if isinstance(image, (bytes, bytearray, memoryview)):
                data = bytes(image)
                extension = _sniff_extension(data) or image_format
            else:
                if isinstance(image, np.ndarray):
                    if image.dtype != np.uint8:
                        raise TypeError(f"sample {count}: image arrays must be uint8, got {image.dtype}")
                    image = Image.fromarray(image)
                if not isinstance(image, Image.Image):
                    raise TypeError(f"sample {count}: image must be a uint8 array, PIL image or bytes")
                data, extension = _encode(image.convert("RGB"), image_format, quality), image_format
            _add_member(tar, f"{key}.{extension}", data)
            _add_member(tar, f"{key}.txt", caption.encode("utf-8") if isinstance(caption, str) else bytes(caption))
            if metadata is not None:
                _add_member(tar, f"{key}.json", json.dumps({"key": key, **metadata}).encode("utf-8"))
        if tar is not None:
            tar.close()
            os.replace(temporary, paths[-1])
            tar = None
    finally:
        if tar is not None:  # an error mid-shard: leave no half-written shard behind
            tar.close()
            temporary.unlink(missing_ok=True)
            paths.pop()
    return paths


def shard_pattern(paths: Sequence[Union[str, Path]]) -> str:
    """A brace pattern for consecutive shards written by write_shards, e.g. 'out/{00000..00009}.tar'."""
    if not paths:
        raise ValueError("no shard paths")
    first, last = Path(paths[0]), Path(paths[-1])
    if len(paths) == 1:
        return str(first)
    return str(first.parent / f"{{{first.stem}..{last.stem}}}.tar")


def csv_to_shards(
    csv_path: Union[str, Path],
    out_dir: Union[str, Path],
    *,
    image_key: str = "filepath",
    caption_key: str = "title",
    separator: Optional[str] = None,
    image_root: Union[str, Path, None] = None,
    samples_per_shard: int = 1000,
    image_format: str = "jpg",
    image_size: Optional[int] = None,
    quality: int = 95,
    decode: DecodeSettings = DecodeSettings(),
    allow_outside_paths: bool = False,
) -> tuple[list[Path], BadSampleCounter]:
    """Convert a CSV / TSV of image path + caption into tar shards, skipping and counting bad rows.

    Image paths must stay inside the CSV's folder (or `image_root`) unless `allow_outside_paths`
    (as CsvDataset; else "path_outside_root"). Every image is decoded to check it. With `image_size`, images whose shorter side is larger are
    downscaled to it and re-encoded as `image_format`; without, JPEG / PNG / WebP files are copied
    byte for byte and other formats re-encoded. Returns (shard paths, counter of kept and skipped rows).
    """
    csv_path = Path(csv_path)
    rows = read_caption_table(csv_path, image_key, caption_key, separator)
    root = Path(image_root) if image_root is not None else csv_path.parent
    counter = BadSampleCounter()
    settings = dataclasses.replace(decode, draft_size=image_size) if image_size is not None else decode

    def good_samples() -> Iterator[tuple[Any, str, dict]]:
        for number, (written, raw_caption) in enumerate(rows, start=1):
            try:
                caption = clean_caption(raw_caption)
                if not written.strip():
                    raise BadSample("missing_file", f"data row {number} has no image path")
                path = resolve_image_path(written, root, allow_outside_paths)
                try:
                    data = path.read_bytes()
                except OSError as error:
                    raise BadSample("missing_file", f"{path}: {error}") from None
                image = decode_image(data, **dataclasses.asdict(settings))
            except BadSample as bad:
                logger.debug("skipped data row %d of %s: %s", number, csv_path, bad)
                counter.add(bad.kind)
                continue
            counter.keep()
            metadata = {"caption": caption, "source": written, "width": image.width, "height": image.height}
            if image_size is not None and min(image.size) > image_size:
                scale = image_size / min(image.size)
                size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
                image = image.resize(size, Image.Resampling.BICUBIC)
                metadata.update(width=image.width, height=image.height)
                yield image, caption, metadata
            elif image_size is None and _sniff_extension(data) in ("jpg", "png", "webp"):
                yield data, caption, metadata
            else:
                yield image, caption, metadata

    paths = write_shards(good_samples(), out_dir, samples_per_shard, image_format, quality)
    return paths, counter
