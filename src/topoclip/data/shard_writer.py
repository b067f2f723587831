"""Writing WebDataset tar shards in img2dataset's layout: samples, or a CSV of image paths + captions, into
shards of N samples (`topoclip data make-shards`). Reading them is topoclip.data.shards.

A sample's members share a key: `000000123.jpg` (the image bytes, re-encoded only when asked),
`000000123.txt` (the caption) and `000000123.json` (its metadata). A CSV's conversion also writes its settings
(conversion.json) and, beside each finished shard, img2dataset's `00001_stats.json` (the CSV rows it covers, kept
and skipped), so a conversion that stopped part-way continues after its last finished shard (`resume`).
"""
from __future__ import annotations

import dataclasses
import io
import itertools
import json
import logging
import os
import re
import sys
import tarfile
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import numpy as np
from PIL import Image

from topoclip.core.atomic import SCRATCH_SUFFIX, scratch_name, write_text_atomic
from topoclip.data.csv import SETTINGS, CaptionTable
from topoclip.data.images import DecodeSettings, clean_caption, decode_image, resolve_image_path
from topoclip.data.quality import BadSample, BadSampleCounter
from topoclip.core.door import is_regular, list_folder, open_regular, parse_json, read_json, regular_file, sha256_file
from topoclip.core.errors import UserError
from topoclip.core.locks import LOCK, claim_folder

logger = logging.getLogger(__name__)


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


CONVERSION = "conversion.json"  # a CSV conversion's settings: what resuming it checks
# What a conversion writes into its folder (shards, their stats, its settings, and their scratch copies).
_WRITTEN = re.compile(r"(?P<scratch>\.)?(?:(?P<shard>\d{5}|[1-9]\d{5,})(?:\.tar|_stats\.json)|conversion\.json)"
                      rf"(?(scratch)\.[0-9a-f]{{12}}{re.escape(SCRATCH_SUFFIX)})")


def _contents(out_dir: Path) -> list[Path]:
    """What a folder holds, but its lock and the scratch files a stopped writer left (removed when it is written)."""
    return [Path(entry.path) for entry in list_folder(out_dir, "shard folder", error=UserError) if entry.name != LOCK
            and not ((match := _WRITTEN.fullmatch(entry.name)) and match["scratch"] and is_regular(entry.path, out_dir))]


def require_empty_folder(out_dir: Union[str, Path]) -> Path:
    """`out_dir`, created if needed; UserError when it holds anything but its lock (writing 00000.tar… among other
    shards would mix two sets and keep the old tail)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    present = sorted(entry.name for entry in _contents(out_dir))
    if CONVERSION in present:
        raise UserError(f"{out_dir} holds a CSV conversion; continue it with --resume (the same --csv and options), "
                        f"or choose another --out")
    if present:
        raise UserError(f"{out_dir} is not empty ({', '.join(present[:3])}{', ...' if len(present) > 3 else ''}); "
                        f"shards are written into a new or empty folder: choose another --out")
    return out_dir


def write_shards(
    samples: Iterable[tuple],
    out_dir: Union[str, Path],
    samples_per_shard: int = 1000,
    image_format: str = "jpg",
    quality: int = 95,
    *,
    first_shard: Optional[int] = None,
    on_shard: Optional[Callable[[Path], None]] = None,
) -> list[Path]:
    """Write (image, caption) or (image, caption, json dict) samples as img2dataset-style tar shards.

    image: uint8 array (H, W, 3) / (H, W), PIL image (encoded as `image_format`: jpg, png or webp) or
    encoded bytes (written unchanged, extension from the magic number, else `image_format`).
    caption: str (written as UTF-8) or bytes (unchanged). Shards are `out_dir/00000.tar`, `00001.tar`, ... in a
    new or empty `out_dir` (UserError otherwise); with `first_shard`, numbered from there in a folder the caller
    has checked (a resumed conversion). Keys are the shard number (5 digits) + the index in the shard, as img2dataset
    writes them. Each shard is written to a temporary name and renamed when it is full (or the samples end); then
    `on_shard(path)` is called. Returns the shard paths written, in order.
    """
    image_format = image_format.lower().lstrip(".")
    if image_format not in _SAVE_FORMATS:
        raise ValueError(f"image_format must be one of {sorted(_SAVE_FORMATS)}, got {image_format!r}")
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be at least 1, got {samples_per_shard}")
    out_dir = require_empty_folder(out_dir) if first_shard is None else Path(out_dir)
    index_digits = len(str(samples_per_shard - 1))
    paths: list[Path] = []
    tar: Optional[tarfile.TarFile] = None
    file = temporary = None

    def finish() -> None:  # the open shard is complete: on disk, into place, then announced
        nonlocal tar
        tar.close()
        tar = None
        file.flush()
        os.fsync(file.fileno())  # (a power loss after the rename finds the whole shard, not an empty file)
        file.close()
        os.replace(temporary, paths[-1])
        if on_shard is not None:
            on_shard(paths[-1])

    try:
        for count, sample in enumerate(samples):
            shard, index = divmod(count, samples_per_shard)
            shard += first_shard or 0
            if tar is None:
                paths.append(out_dir / f"{shard:05d}.tar")
                temporary = scratch_name(paths[-1])
                file = open(temporary, "xb")  # a new name: never a file of the user's
                tar = tarfile.open(fileobj=file, mode="w", format=tarfile.GNU_FORMAT)
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
            if index == samples_per_shard - 1:
                finish()
        if tar is not None:
            finish()
    finally:
        if file is not None and not file.closed:  # an error mid-shard: leave no half-written shard behind
            try:
                file.close()  # (not the tar's close, which writes its end and fails again on a full disk)
            finally:
                temporary.unlink(missing_ok=True)
                paths.pop()
    return paths


def shard_pattern(paths: Sequence[Union[str, Path]]) -> str:
    """A brace pattern for consecutive shards written by write_shards, e.g. 'out/{00000..00009}.tar'.

    A range is written per name width: braceexpand pads every number of '{00000..100001}' to six digits, so past
    shard 99,999 the pattern is '{{00000..99999},{100000..100001}}'. The folder's braces and backslashes are
    escaped, which also keeps a '${NAME}' in it from webdataset's variable substitution; a folder holding '::' (which
    webdataset reads as a separator between patterns) cannot be named and is refused."""
    from topoclip.data.shards import is_local

    paths = [Path(path) for path in paths]
    if paths and "::" in str(paths[0].parent):
        raise ValueError(f"shard folder {str(paths[0].parent)!r} holds '::', which webdataset reads "
                         f"as a separator between shard patterns; write the shards into a folder without it")
    numbers = [int(path.stem) if path.stem.isdigit() else -1 for path in paths]
    if not paths or min(numbers) < 0 or numbers != list(range(numbers[0], numbers[0] + len(paths))) \
            or len({path.parent for path in paths}) > 1:
        raise ValueError(f"shard_pattern takes consecutive shards of one folder, as write_shards returns them; got "
                         f"{[str(path) for path in paths[:3]]}{' ...' if len(paths) > 3 else ''}")
    groups = [list(group) for _, group in itertools.groupby((path.stem for path in paths), key=len)]
    ranges = [group[0] if len(group) == 1 else f"{{{group[0]}..{group[-1]}}}" for group in groups]
    folder = str(paths[0].parent)
    if not is_local(folder):  # a relative 'run:2' or 'shards-T10:00' would read as a URL scheme, 'pipe:x' as a command
        folder = f"./{folder}"
    folder = re.sub(r"([\\{}])", r"\\\1", folder)  # a backslash before each backslash and brace
    # '/' and not os.sep: after a Windows folder's (escaped) backslash, one more would escape the pattern's brace.
    return f"{folder}/{ranges[0]}.tar" if len(ranges) == 1 else f"{folder}/{{{','.join(ranges)}}}.tar"


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
    resume: bool = False,
    progress: bool = False,
    names: Mapping[str, str] = SETTINGS,
) -> tuple[list[Path], BadSampleCounter]:
    """Convert a CSV / TSV of image path + caption into tar shards, skipping and counting bad rows.

    Image paths must stay inside the CSV's folder (or `image_root`) unless `allow_outside_paths`
    (as CsvDataset; else "path_outside_root"). Every image is decoded to check it. With `image_size`, images whose shorter side is larger are
    downscaled to it and re-encoded as `image_format`; without, JPEG / PNG / WebP files are copied
    byte for byte and other formats re-encoded. Returns (every shard of the folder, counter of kept and skipped rows);
    UserError when no row gave a sample (conversion.json removed: the folder is new again).

    The folder is new or empty, and locked while it is written. Each shard's stats cover the rows read since the last
    one's, the last shard's every row to the end; conversion.json holds the settings, and the totals once it has
    finished. `resume`: the folder holds this conversion (the same CSV, byte for byte, and settings), stopped
    part-way, and it continues after its last finished shard, writing what an uninterrupted conversion writes.
    `progress`: a bar of the CSV's bytes while they are hashed, then one of the rows read. `names`: the options the
    errors name (CaptionTable's).
    """
    csv_path = Path(csv_path)
    rows = CaptionTable(csv_path, image_key, caption_key, separator, names)  # header checked now, rows read as written
    root = Path(image_root) if image_root is not None else csv_path.parent
    settings = dataclasses.replace(decode, draft_size=image_size) if image_size is not None else decode
    out_dir = Path(out_dir)
    if resume and not (out_dir / CONVERSION).exists():
        fix = ("convert into it without --resume" if not out_dir.is_dir() or not _contents(out_dir)
               else "remove its files, or choose another --out")
        raise UserError(f"{out_dir} holds no conversion to resume ({CONVERSION} is missing); {fix}")
    record = {"csv": str(csv_path.resolve()), "csv_sha256": sha256_file(csv_path, progress), "image_key": image_key,
              "caption_key": caption_key, "separator": rows.separator,
              "image_root": None if image_root is None else str(root.resolve()),  # None: the CSV's folder, wherever
              "samples_per_shard": samples_per_shard, "image_format": image_format.lower().lstrip("."),
              "image_size": image_size, "quality": quality, "decode": dataclasses.asdict(decode),
              "allow_outside_paths": allow_outside_paths}
    with claim_folder(out_dir, "shard folder"):
        if resume:
            first_shard, first_row, counter, finished = _resume_point(out_dir, record, root, allow_outside_paths)
            if finished:
                return _shards(out_dir), counter
        else:
            require_empty_folder(out_dir)
            for entry in list_folder(out_dir, "shard folder", error=UserError):  # a stopped first write's scratch
                if entry.name != LOCK:  # (we hold the lock: nobody writes it)
                    os.unlink(entry.path)
            write_text_atomic(out_dir / CONVERSION, json.dumps(record, indent=1) + "\n")
            first_shard, first_row, counter = 0, 0, BadSampleCounter()
        read = first_row  # rows read so far; a shard covers the rows read since the last one ended
        shard_start, before = first_row, BadSampleCounter(counter.kept, counter.bad)

        def good_samples() -> Iterator[tuple[Any, str, dict]]:
            nonlocal read
            from tqdm.auto import tqdm

            with tqdm(itertools.islice(rows, first_row, None), desc="convert", unit=" rows", initial=first_row,
                      disable=not progress) as bar:
                for written, raw_caption in bar:
                    read += 1
                    try:
                        caption = clean_caption(raw_caption)
                        if not written.strip():
                            raise BadSample("missing_file", f"data row {read} has no image path")
                        data = _read_image_file(resolve_image_path(written, root, allow_outside_paths), decode)
                        image = decode_image(data, **dataclasses.asdict(settings))
                    except BadSample as bad:
                        logger.debug("skipped data row %d of %s: %s", read, csv_path, bad)
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

        def record_shard(path: Path, previous: Optional[dict] = None) -> None:
            """img2dataset's NNNNN_stats.json: the rows since the last shard's (added to `previous`, its stats)."""
            nonlocal shard_start, before
            stats = previous or {"rows": [shard_start, shard_start], "count": 0, "successes": 0, "skipped": {}}
            skipped = dict(stats["skipped"])
            for kind, count in counter.bad.items():
                if count > before.bad.get(kind, 0):
                    skipped[kind] = skipped.get(kind, 0) + count - before.bad.get(kind, 0)
            stats = {"rows": [stats["rows"][0], read], "count": stats["count"] + read - shard_start,
                     "successes": stats["successes"] + counter.kept - before.kept, "skipped": skipped}
            write_text_atomic(path.with_name(f"{path.stem}_stats.json"), json.dumps(stats) + "\n")
            shard_start, before = read, BadSampleCounter(counter.kept, counter.bad)

        samples = good_samples()
        try:
            with warnings.catch_warnings(record=True) as said:  # (the table's: said below the progress bar)
                warnings.simplefilter("always")
                write_shards(samples, out_dir, samples_per_shard, image_format, quality, first_shard=first_shard,
                             on_shard=record_shard)
        finally:
            samples.close()  # the progress bar ends before any message
        for warning in said:
            print(f"topoclip: warning: {warning.message}", file=sys.stderr)
        shards = _shards(out_dir)
        if not shards:  # nothing to train on: refused, and nothing left that a new conversion must resume
            (out_dir / CONVERSION).unlink()
            raise UserError(f"{csv_path} has no data rows" if not read else
                            f"no row of {csv_path} gave a sample ({counter.describe()}), so no shard was written: fix "
                            f"what the counts name (image paths are read relative to {root}) and convert again")
        if read > shard_start:  # the rows after the last full shard, all skipped: its stats take them
            last = shards[-1].with_name(f"{shards[-1].stem}_stats.json")
            record_shard(shards[-1], read_json(last, "shard stats", out_dir, expect=dict, error=UserError))
        finished = {"rows": read, "successes": counter.kept, "skipped": counter.bad}
        write_text_atomic(out_dir / CONVERSION, json.dumps({**record, "finished": finished}, indent=1) + "\n")
    return shards, counter


def _read_image_file(path: Path, decode: DecodeSettings) -> bytes:
    """The bytes of an image file; BadSample "missing_file" for what is not a regular file (a link to a device or a
    FIFO would be read forever), "huge_image" past the largest file an allowed image needs: max_pixels stored raw at
    4 bytes a pixel (RGBA BMP / PPM), plus 1 MiB of header and metadata."""
    largest = decode.max_pixels * 4 + 2**20
    try:
        with open_regular(path, "image", limit=None, error=_Refused) as file:
            size = os.fstat(file.fileno()).st_size
            if size > largest:
                raise BadSample("huge_image", f"{path}: {size:,} bytes, more than an image of max_pixels "
                                              f"{decode.max_pixels:,} needs")
            return file.read(largest + 1)
    except (OSError, _Refused) as error:
        raise BadSample("missing_file", f"{path}: {error}") from None


class _Refused(ValueError):
    """What the door says of an image path that is not a regular file (a link to a device, a FIFO)."""


def _number(name: str) -> int:
    """The shard number of a shard's tar or stats file name."""
    return int(_WRITTEN.fullmatch(name)["shard"])


def _shards(out_dir: Path) -> list[Path]:
    """The finished shards of a conversion's folder, in order."""
    return sorted((Path(entry.path) for entry in list_folder(out_dir, "shard folder", error=UserError)
                   if entry.name.endswith(".tar") and _WRITTEN.fullmatch(entry.name)), key=lambda p: _number(p.name))


SAMPLE_JSON_BYTES = 1 << 20  # a shard sample's .json (its source path and row): the largest one resuming reads


def _check_last_shard(tar_path: Path, kept: int, root: Path, allow_outside: bool, fix: str, redo: str) -> None:
    """The last finished shard holds its stats' samples, and their images are still where the CSV points (a CSV moved
    without its images would count every later row missing). `fix`: the way out of a refusal; `redo`: of a shard's."""
    try:
        with tarfile.open(regular_file(tar_path, "shard", error=UserError)) as tar:
            records = [member for member in tar.getmembers() if member.name.endswith(".json")]
            if any(member.size > SAMPLE_JSON_BYTES for member in records):  # what write_shards writes is ~200 bytes
                raise ValueError(f"a .json member is over {SAMPLE_JSON_BYTES:,} bytes")
            sources = [parse_json(tar.extractfile(member).read(), member.name, error=ValueError)["source"]
                       for member in records]
        if not all(isinstance(source, str) for source in sources):
            raise ValueError("a sample's source is not an image path")
    except (OSError, tarfile.TarError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"{tar_path} cannot be read ({type(error).__name__}: {error}); {redo}") from None
    if len(sources) != kept:
        raise UserError(f"{tar_path} holds {len(sources)} samples, its stats {kept}; {redo}")
    for source in sources:
        try:
            found = resolve_image_path(source, root, allow_outside).is_file()
        except BadSample:
            found = False
        if not found:
            raise UserError(f"the images this conversion read are not where the CSV points now ({source!r} under "
                            f"{root} is missing): resume with the CSV where it was, or {fix}")


def _read_stats(path: Path, row: int, fix: str) -> tuple[int, int, dict[str, int]]:
    """(the row after the shard's last, kept, skipped by kind) from a shard's stats, which must start at `row`."""
    try:
        stats = read_json(path, "shard stats", expect=dict, error=ValueError)
        (first, last), kept, skipped = stats["rows"], stats["successes"], stats["skipped"]
        numbers = [first, last, kept, stats["count"], *skipped.values()]
        if not all(type(n) is int and n >= 0 for n in numbers) or not all(isinstance(k, str) for k in skipped) \
                or stats["count"] != last - first or kept + sum(skipped.values()) != last - first:
            raise ValueError("its rows, count, successes and skipped do not add up")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
        raise UserError(f"{path} cannot be read ({type(error).__name__}: {error}); {fix}") from None
    if first != row:
        raise UserError(f"{path} starts at row {first}, not {row}: the shards are not one conversion; {fix}")
    return last, kept, skipped


def _resume_point(out_dir: Path, record: dict, root: Path, allow_outside: bool) -> tuple[int, int, BadSampleCounter, bool]:
    """(the next shard's number, the next CSV row, the counts so far, whether it had finished) of the conversion
    `record` stopped in `out_dir`; what it wrote after its last finished shard (that shard's tar without its stats,
    scratch files) is removed. UserError when the folder holds another conversion, or files it did not write, or
    when the images its last finished shard read are no longer where the CSV (under `root`) points."""
    fix = "convert into another --out"
    try:
        saved = read_json(out_dir / CONVERSION, "conversion record", out_dir, expect=dict, error=ValueError)
    except (OSError, ValueError) as error:
        raise UserError(f"{out_dir / CONVERSION} cannot be read ({error}); {fix}") from None
    changed = [f"{key}: {saved.get(key)!r} then, {record[key]!r} now" for key in record
               if key != "csv" and saved.get(key) != record[key]]  # (a moved CSV is the same)
    if changed:
        raise UserError(f"{out_dir} holds a conversion with other settings ({'; '.join(changed)}): resume it with the "
                        f"same CSV and options, or {fix}")
    entries = {entry.name: Path(entry.path) for entry in list_folder(out_dir, "shard folder", error=UserError)
               if entry.name != LOCK}
    foreign = sorted(name for name, entry in entries.items() if not is_regular(entry, out_dir) or not _WRITTEN.fullmatch(name))
    if foreign:  # (claim_folder refused links and special files)
        raise UserError(f"{out_dir} holds files a conversion does not write ({', '.join(foreign[:3])}): remove them, "
                        f"or {fix}")
    shard, row, counter = 0, 0, BadSampleCounter()
    redo = f"remove it and every later shard and stats file (they are written again), or {fix}"
    while f"{shard:05d}.tar" in entries and f"{shard:05d}_stats.json" in entries:
        row, kept, skipped = _read_stats(entries[f"{shard:05d}_stats.json"], row, redo)
        counter.keep(kept)
        counter += skipped
        shard += 1
    unfinished = [name for name in entries if name.endswith(SCRATCH_SUFFIX) or name == f"{shard:05d}.tar"]
    later = sorted((name for name in entries if name not in unfinished and name != CONVERSION and _number(name) >= shard),
                   key=_number)
    if later:
        raise UserError(f"{out_dir} lacks shard {shard:05d}'s tar or stats, though later ones exist ({later[0]}): "
                        f"restore it, or remove every shard and stats file from {shard:05d} on (they are written again)")
    if shard:
        _check_last_shard(entries[f"{shard - 1:05d}.tar"], kept, root, allow_outside, fix, redo)
    for name in unfinished:
        entries[name].unlink()
    # Finished: its totals are the stats' (a shard removed from the end since is written again).
    finished = saved.get("finished") == {"rows": row, "successes": counter.kept, "skipped": counter.bad} and shard > 0
    state = "finished" if finished else f"resuming at shard {shard:05d}, CSV row {row + 1}"
    print(f"topoclip: {out_dir}: {state}" + (f" (removed {len(unfinished)} unfinished file(s))" if unfinished else ""),
          file=sys.stderr)
    return shard, row, counter, finished
