"""Training data sources: one registry entry each, as the topologies are in geometry.py.

    scenes   the built-in generated scenes: a function of the step (exactly resumable, no position)
    csv      a CSV/TSV of image path + caption, read as a stream
    shards   WebDataset tar shards (img2dataset's layout), read as a stream
    hf       a Hugging Face `datasets` folder or Parquet / Arrow files, its rows read as a CSV's

An entry says what the rest of topoclip asks of a source: its config checks, whether it is a stream
(a stream keeps a position that a checkpoint saves; the scenes are indexed by the step instead), the
training batches of one rank, up to N captions for a new vocabulary, the samples of one epoch (for τ's
convergence window), and which parts of `data.train_data` would run a command.
Adding a source is one entry here (and its reader in topoclip/data/).

Functions take the config sections they read (duck-typed: this module sits below topoclip.config).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

class SourceError(ValueError):
    """Settings a data source cannot use; topoclip.config turns it into a ConfigError."""


@dataclass(frozen=True)
class DataSource:
    # Refuse settings this source cannot use (data and the rest of the config): raise SourceError.
    check: Callable[[Any], None]
    # A stream (True) is read in order and resumes from a saved position; False: indexed by the step.
    stream: bool
    # The training batches of one rank: batches(config, start_step, rank, world_size, loader_options, *,
    # tokenizer=, pin_memory=, stream=) -> an endless iterator of RawBatch (topoclip.run.training.data calls it).
    batches: Callable[..., Iterator[Any]]
    # Up to `count` clean captions of the training data (for training a new vocabulary).
    captions: Callable[[Any, int], list[str]]
    # Samples of one epoch, or None when the data has no fixed epoch.
    epoch_samples: Callable[[Any], Optional[int]]
    # The URLs data.train_data expands to that would be read through a command or the network (pipe:, http:).
    commands: Callable[[Any], list[str]] = lambda data: []
    # Evaluation sets the source brings itself: (config, split) -> (classification sets, retrieval sets).
    evaluation_sets: Callable[[Any, str], tuple[list, list]] = lambda config, split: ([], [])
    # The files a run will read, opened as far as is cheap before its run folder is made (a CSV's header, a batch of
    # its rows), given the data and the global batch: a SourceError naming the problem and the fix, so a bad table
    # fails before it leaves a folder behind.
    ready: Callable[[Any, int], None] = lambda data, batch_size: None


# --------------------------------------------------------------------------- scenes


def check_scenes(config) -> None:
    """The built-in scenes must hold a training batch and the evaluations' images."""
    scenes, train = config.data.scenes, config.train
    if scenes.train_size < train.batch_size:
        raise SourceError(f"data.scenes.train_size={scenes.train_size} is smaller than train.batch_size="
                          f"{train.batch_size}; raise data.scenes.train_size or lower train.batch_size")
    if scenes.test_size < 1:
        raise SourceError("data.scenes.test_size=0 leaves the final evaluation no image; set data.scenes.test_size ≥ 1 "
                          "(e.g. 2000, the default)")
    if train.eval_every and scenes.val_size < 1:
        raise SourceError(f"data.scenes.val_size=0 leaves the evaluations every {train.eval_every} steps no image; "
                          f"set data.scenes.val_size ≥ 1 or train.eval_every=0")


def scene_evaluation_sets(config, split: str) -> tuple[list, list]:
    """Every built-in classification set, and in- and out-of-domain retrieval, of the split's scenes.

    The "val" split (periodic evaluation during training) uses evaluate.validation_size images per set.
    """
    from topoclip.data.scenes import classification_sets, retrieval_set

    scenes, settings = config.data.scenes, config.evaluate
    wanted = settings.validation_size if split == "val" else settings.size
    size = min(wanted, scenes.size_of(split))  # retrieval reads the split's own images
    return (classification_sets(scenes, split, size=wanted),
            [retrieval_set(scenes, split, size, settings.captions_per_image),
             retrieval_set(scenes, split, size, settings.captions_per_image, style="out-of-domain")])


def scene_captions(data, count: int) -> list[str]:
    from topoclip.data.scenes import SceneDataset

    scenes = SceneDataset(data.scenes, "train")
    return [scenes.clean_caption(i).text for i in range(min(len(scenes), count))]


# --------------------------------------------------------------------------- streams


def scene_batches(config, *arguments, **options):
    from topoclip.data.scene_batches import scene_batches

    return scene_batches(config, *arguments, **options)


def check_stream(config) -> None:
    if not config.data.train_data:
        raise SourceError(f"data.source={config.data.source!r} needs data.train_data (a CSV path, a shard pattern or a "
                          f"datasets folder)")


def csv_batches(config, *arguments, **options):
    from topoclip.data.streams import stream_batches

    return stream_batches(open_csv, config, *arguments, **options)


def open_csv(data, **options):
    """The CSV as one rank's IterableDataset of RawBatch (options: transform, batch_size, seed, rank, world_size,
    crop_generator)."""
    from topoclip.data.csv import CsvDataset

    return CsvDataset(data.train_data, image_key=data.csv_image_key, caption_key=data.csv_caption_key,
                      separator=data.csv_separator or None, drop_last=True,
                      allow_outside_paths=data.csv_allow_outside_paths, **options)


def clean_captions(raws) -> list[str]:
    """The usable captions of `raws`, cleaned; one that is not is counted when training reads its row, here only
    left out."""
    from topoclip.data.images import clean_caption
    from topoclip.data.quality import BadSample

    captions = []
    for raw in raws:
        try:
            captions.append(clean_caption(raw))
        except BadSample:
            pass
    return captions


def csv_captions(data, count: int) -> list[str]:
    from topoclip.data.csv import CaptionTable

    rows = CaptionTable(data.train_data, data.csv_image_key, data.csv_caption_key, data.csv_separator or None)
    return clean_captions(raw for _, raw in itertools.islice(rows, count))


def csv_ready(data, batch_size: int) -> None:
    """The table exists, is a regular file, has the image and caption columns (CaptionTable's checks) and at least
    one batch of rows (read up to that many: a table is never counted whole here)."""
    from topoclip.data.csv import CaptionTable

    try:
        table = CaptionTable(data.train_data, data.csv_image_key, data.csv_caption_key, data.csv_separator or None)
    except FileNotFoundError as error:
        raise SourceError(str(error)) from None
    rows = sum(1 for _ in itertools.islice(table, batch_size))
    if not rows:
        raise SourceError(f"{data.train_data} has a header but no rows (setting data.train_data)")
    check_one_batch(data, rows, batch_size)


def check_one_batch(data, rows: int, batch_size: int) -> None:
    """SourceError when a table's `rows` fill no batch: the loader drops a last partial batch, so nothing would train."""
    if rows < batch_size:
        raise SourceError(f"{data.train_data} holds {rows:,} rows, fewer than one batch of {batch_size:,} "
                          f"(train.batch_size, the global batch): give more rows or a smaller batch")


def csv_rows(data) -> Optional[int]:
    """One epoch of a CSV is one pass over its rows (as OpenCLIP's); None when the file cannot be read yet."""
    from topoclip.data.csv import CaptionTable

    try:
        return sum(1 for _ in CaptionTable(data.train_data, data.csv_image_key, data.csv_caption_key,
                                           data.csv_separator or None)) or None
    except (OSError, ValueError):  # said when training opens it, with its own message
        return None


def hf_batches(config, *arguments, **options):
    from topoclip.data.streams import stream_batches

    return stream_batches(open_hf, config, *arguments, **options)


def hf_rows(data):
    from topoclip.data.hf import HfRows

    return HfRows(data.train_data, data.hf_image_column, data.hf_caption_column, data.hf_split)


def open_hf(data, **options):
    """A Hugging Face dataset as one rank's IterableDataset of RawBatch (the options of open_csv): its rows read as
    a CSV's are (topoclip.data.hf)."""
    from topoclip.data.csv import CsvDataset

    rows = hf_rows(data)
    return CsvDataset(data.train_data, rows=rows, image_root=rows.root, drop_last=True,
                      allow_outside_paths=data.csv_allow_outside_paths, **options)


def hf_captions(data, count: int) -> list[str]:
    return clean_captions(hf_rows(data).captions(count))


def hf_ready(data, batch_size: int) -> None:
    """The dataset opens, has image and caption columns of usable types (HfRows' checks), at least one batch of
    rows, and captions and reachable images among its first batch (hf.check_first_rows)."""
    from topoclip.data.hf import check_first_rows

    try:
        rows = hf_rows(data)
    except FileNotFoundError as error:
        raise SourceError(str(error)) from None
    if not len(rows):
        raise SourceError(f"{data.train_data} has no rows (setting data.train_data)")
    check_one_batch(data, len(rows), batch_size)
    check_first_rows(rows, batch_size, data.csv_allow_outside_paths, data.train_data)


def hf_size(data) -> Optional[int]:
    """One epoch of a dataset is one pass over its rows; None when it cannot be read yet (said when training opens it)."""
    try:
        return len(hf_rows(data)) or None
    except (OSError, ValueError):
        return None


def shard_batches(config, *arguments, **options):
    from topoclip.data.streams import stream_batches

    return stream_batches(open_shards, config, *arguments, **options)


def open_shards(data, **options):
    """The shards as one rank's IterableDataset of RawBatch (the options of open_csv)."""
    from topoclip.data.shards import ShardDataset

    return ShardDataset(data.train_data, weights=data.weights or None, resampled=data.resampled,
                        samples_per_epoch=data.samples_per_epoch or None, shuffle_buffer=data.shuffle_buffer,
                        drop_last=True, **options)


def shard_captions(data, count: int) -> list[str]:
    from topoclip.data.shards import read_captions

    return read_captions(data.train_data, count)


def shard_commands(data) -> list[str]:
    """The URLs data.train_data expands to (braces and ${WDS_VAR}, as webdataset expands them) that webdataset
    would open through a command or the network."""
    from topoclip.data.shards import command_urls

    try:
        return command_urls(data.train_data)
    except ValueError as error:
        raise SourceError(f"data.train_data: {error}") from None


SOURCES: dict[str, DataSource] = {
    "scenes": DataSource(check_scenes, stream=False, batches=scene_batches, captions=scene_captions,
                         epoch_samples=lambda data: data.scenes.train_size, evaluation_sets=scene_evaluation_sets),
    "csv": DataSource(check_stream, stream=True, batches=csv_batches, captions=csv_captions, epoch_samples=csv_rows,
                      ready=csv_ready),
    "hf": DataSource(check_stream, stream=True, batches=hf_batches, captions=hf_captions, epoch_samples=hf_size,
                     ready=hf_ready),
    "shards": DataSource(check_stream, stream=True, batches=shard_batches, captions=shard_captions,
                         epoch_samples=lambda data: data.samples_per_epoch or None, commands=shard_commands),
}


def get_source(name: str) -> DataSource:
    """The registry entry for `name`, or a SourceError listing the known names."""
    try:
        return SOURCES[name]
    except KeyError:
        raise SourceError(f"data.source={name!r} is unknown; choose one of {sorted(SOURCES)}") from None


def check_readable(data, batch_size: int) -> None:
    """The source's `ready` check: what a run will read, opened before anything is written (SourceError)."""
    get_source(data.source).ready(data, batch_size)


def epoch_steps(data, batch_size: int) -> Optional[int]:
    """Optimiser steps per epoch of the training data, or None when it has no fixed epoch: a stream's loader drops
    the last partial batch (the epoch it reads is whole batches), the scenes' cycle counts it. SourceError when a
    stream's epoch holds no whole batch."""
    source = get_source(data.source)
    samples = source.epoch_samples(data)
    if not samples:
        return None
    if source.stream and samples < batch_size:
        raise SourceError(f"{data.train_data} holds {samples:,} samples, fewer than one batch of {batch_size:,} "
                          f"(train.batch_size, the global batch): its epoch has no whole batch")
    return samples // batch_size if source.stream else max(1, math.ceil(samples / batch_size))
