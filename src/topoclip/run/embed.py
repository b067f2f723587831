"""Bulk embedding (`topoclip embed`): images and texts -> embedding shards, as clip-retrieval's `inference`.

Output folder, one shard per SHARD_SIZE inputs (an input whose image cannot be read is skipped and
counted, so a shard may hold fewer rows)::

    OUT/img_emb/img_emb_00000.npy     (rows, m, n) float32, or (rows, m·n) with flat=True
    OUT/img_emb/img_keys_00000.json   the rows' keys: file paths relative to the folder, CSV paths, shard keys
    OUT/img_emb/img_stats_00000.json  the shard's kept and skipped inputs (embed.json adds them up)
    OUT/text_emb/text_emb_00000.npy   the same for texts; keys are the line numbers of the text file
    OUT/embed.json                    the model, the shape, the topology (and a hyperbolic model's curvature), the
                                      counts of embedded and skipped inputs

Inputs are read in one fixed order (sorted files; CSV rows; shards in order, members in tar order), so
shard i always covers inputs [i·SHARD_SIZE, (i+1)·SHARD_SIZE). A shard's files are written atomically,
keys last; a run that is killed resumes after its last complete shard and writes what an
uninterrupted run writes. The folder belongs to one process at a time (a lock).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch
from tqdm.auto import tqdm

from topoclip.data.images import DecodeSettings, decode_image, image_files, resolve_image_path
from topoclip.data.quality import BadSample, BadSampleCounter
from topoclip.core.door import CAPTIONS_BYTES, read_json, read_text, sha256_file
from topoclip.core.errors import DiskFullError, UserError, is_disk_full
from topoclip.core.geometry import require_flat
from topoclip.core.workers import worker_options

SHARD_SIZE = 10_000
SUMMARY = "embed.json"
KINDS = {"image": ("img_emb", "img"), "text": ("text_emb", "text")}  # folder, file prefix
# How a resume names the recorded hashes that changed.
CHANGES = {"weights_sha256": "the weights (the model has a newer checkpoint?)", "images_sha256": "the image files "
           "listed", "texts_sha256": "the lines of --texts"}


@dataclass(frozen=True)
class ImageInput:
    """One image to embed: its key and where its bytes are (a file path, or a TarMember), or why there are none
    (a BAD_SAMPLE_KINDS key)."""

    key: str
    source: object
    bad: str = ""

    def image(self, decode: DecodeSettings):
        data = self.source.read() if hasattr(self.source, "read") else self.source
        return decode_image(data, decode.min_size, decode.max_pixels)


def list_images(source: Union[str, Path], image_key: str = "filepath") -> list[ImageInput]:
    """The images of a folder (recursively), a CSV / TSV (its `image_key` column, paths inside its folder)
    or local WebDataset shards (a brace pattern of .tar files), in their fixed order."""
    from topoclip.data.benchmark_sets import WDS_IMAGE_EXTENSIONS, _samples
    from topoclip.data.shards import command_urls, expand_shard_sources

    text = str(source)
    path = Path(text)
    if path.is_dir():
        return [ImageInput(str(file.relative_to(path)), file) for file in image_files(path)]
    if path.suffix.lower() in (".csv", ".tsv", ".tab") and path.is_file():
        from topoclip.data.csv import CaptionTable

        inputs = []
        names = {"path": "--images", "image_key": "--image-key", "separator": "a .tsv file name for tabs"}
        for written, _ in CaptionTable(path, image_key, caption_key=None, names=names):
            try:
                inputs.append(ImageInput(written, resolve_image_path(written, path.parent)))
            except BadSample as bad:  # outside the CSV's folder: never opened, counted
                inputs.append(ImageInput(written, None, bad.kind))
        return inputs
    if ".tar" in text:
        try:
            remote = command_urls(text)
            shards, _ = expand_shard_sources(text)
        except ValueError as error:
            raise UserError(str(error)) from None
        if remote:
            raise UserError(f"{text} expands to {remote[0]!r}: topoclip embed reads local shards only")
        inputs = []
        for shard in shards:
            if not Path(shard).exists():
                raise FileNotFoundError(f"shard {shard} does not exist")
            try:
                samples = _samples(Path(shard))
            except ValueError as error:  # not a readable tar: named, with the fix
                raise UserError(str(error)) from None
            for key, members in samples.items():
                member = next((members[ext] for ext in (*WDS_IMAGE_EXTENSIONS, "jpe", "bmp", "tif", "tiff")
                               if ext in members), None)
                inputs.append(ImageInput(key, member, "" if member else "unpaired_member"))
        return inputs
    raise FileNotFoundError(f"{text}: not a folder, a .csv/.tsv file or .tar shards (e.g. 'shards/{{00000..00009}}.tar')")


class _Pixels(torch.utils.data.Dataset):
    """inputs[i] -> (i, pixels (3, S, S) or None, bad kind or None), decoded in DataLoader workers."""

    def __init__(self, inputs: Sequence[ImageInput], transform: Callable, decode: DecodeSettings):
        self.inputs, self.transform, self.decode = inputs, transform, decode

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int):
        item = self.inputs[index]
        if item.bad:
            return index, None, item.bad
        try:
            return index, self.transform(item.image(self.decode)), None
        except BadSample as bad:
            return index, None, bad.kind


def _collate(batch):
    return batch


class ShardWriter:
    """Embedding shards of one kind in OUT/<folder>/, written atomically: the .npy, its counts, then the keys."""

    def __init__(self, out: Path, kind: str):
        folder, self.prefix = KINDS[kind]
        self.folder = out / folder
        self.folder.mkdir(parents=True, exist_ok=True)

    def paths(self, index: int) -> tuple[Path, Path]:
        return (self.folder / f"{self.prefix}_emb_{index:05d}.npy", self.folder / f"{self.prefix}_keys_{index:05d}.json")

    def stats_path(self, index: int) -> Path:
        """The shard's kept and skipped inputs (a summary after a resume adds up every shard's)."""
        return self.folder / f"{self.prefix}_stats_{index:05d}.json"

    def complete(self) -> int:
        """The number of complete shards from the first on (a shard is complete once its keys file exists)."""
        index = 0
        while all(path.is_file() for path in self.paths(index)):
            index += 1
        return index

    def counts(self, shards: int) -> BadSampleCounter:
        """The counts of shards 0 … shards-1 (a shard written before counts were kept adds nothing)."""
        total = BadSampleCounter()
        for index in range(shards):
            try:
                counts = read_json(self.stats_path(index), "shard stats", self.folder, error=ValueError)
                total += BadSampleCounter(counts["kept"], counts["bad"])
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
        return total

    def write(self, index: int, embeddings: np.ndarray, keys: list[str], counter: BadSampleCounter) -> None:
        from topoclip.core.atomic import write_atomic, write_text_atomic

        array, key_file = self.paths(index)
        try:
            write_atomic(array, lambda file: np.save(file, embeddings))
            write_text_atomic(self.stats_path(index), json.dumps(counter.as_dict()))
            write_text_atomic(key_file, json.dumps(keys))
        except OSError as error:
            if not is_disk_full(error):
                raise
            raise DiskFullError(f"no space left on {self.folder} while writing shard {index} (nothing of it is kept; "
                                f"shards before it are complete): free space and run the same command to resume",
                                self.folder) from None


def _embed_in_shards(writer: ShardWriter, total: int, shard_size: int, unit: str, progress: bool,
                     embed_range: Callable[[int, int, BadSampleCounter], tuple[np.ndarray, list[str]]]) -> dict:
    """Shards `writer.complete()` … of `total` inputs, each from embed_range(start, stop, counter) -> (rows, keys);
    the counts cover every shard, those of an earlier, interrupted run too."""
    done = writer.complete()
    shards = -(-total // shard_size)
    with tqdm(total=total, initial=min(done * shard_size, total), desc=unit + "s", unit=unit,
              disable=not progress) as bar:  # (closed on any error too: a message after it starts a line)
        for shard in range(done, shards):
            start, stop = shard * shard_size, min((shard + 1) * shard_size, total)
            counter = BadSampleCounter()
            embeddings, keys = embed_range(start, stop, counter)
            writer.write(shard, embeddings, keys, counter)
            bar.update(stop - start)
    return {"inputs": total, "resumed_after_shards": done, **writer.counts(shards).as_dict()}


def _rows(clip, blocks: list[torch.Tensor], flat: bool) -> np.ndarray:
    """The shard's float32 rows (rows, m, n) or (rows, m·n); an empty shard keeps the shape."""
    shape = clip.model.embedding_shape if not flat else (int(np.prod(clip.model.embedding_shape)),)
    return torch.cat(blocks).cpu().numpy().astype(np.float32) if blocks else np.zeros((0, *shape), np.float32)


def embed_images(clip, inputs: Sequence[ImageInput], out: Path, flat: bool = False, batch_size: int = 256,
                 shard_size: int = SHARD_SIZE, num_workers: int = 2, progress: bool = True,
                 decode: DecodeSettings = DecodeSettings()) -> dict:
    """Embed `inputs` into image shards under `out` (resuming after the last complete shard); returns counts."""

    def embed_range(start: int, stop: int, counter: BadSampleCounter):
        loader = torch.utils.data.DataLoader(_Pixels(inputs[start:stop], clip.transform, decode), batch_size=batch_size,
                                             collate_fn=_collate, **worker_options(num_workers))
        blocks, keys = [], []
        for batch in loader:
            good = [(index, pixels) for index, pixels, bad in batch if pixels is not None]
            for _, _, bad in batch:
                if bad:
                    counter.add(bad)
                else:
                    counter.keep()
            if good:
                blocks.append(clip.encode_image(torch.stack([pixels for _, pixels in good]), batch_size, flat=flat))
                keys += [inputs[start + index].key for index, _ in good]
        return _rows(clip, blocks, flat), keys

    return _embed_in_shards(ShardWriter(out, "image"), len(inputs), shard_size, "image", progress, embed_range)


def embed_texts(clip, texts: Sequence[str], out: Path, flat: bool = False, batch_size: int = 256,
                shard_size: int = SHARD_SIZE, progress: bool = True) -> dict:
    """Embed `texts` into text shards under `out` (keys: line numbers from 1; empty lines skipped and counted)."""

    def embed_range(start: int, stop: int, counter: BadSampleCounter):
        kept = [(number, text.strip()) for number, text in enumerate(texts[start:stop], start=start + 1) if text.strip()]
        counter.keep(len(kept))
        counter.add("empty_caption", (stop - start) - len(kept))
        blocks = [clip.encode_text([text for _, text in kept], batch_size, flat=flat)] if kept else []
        return _rows(clip, blocks, flat), [str(number) for number, _ in kept]

    return _embed_in_shards(ShardWriter(out, "text"), len(texts), shard_size, "text", progress, embed_range)


def _sha256_lines(lines: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode("utf-8", "surrogatepass")).hexdigest()


def _read_texts(path) -> list[str]:
    """The lines of a --texts file; UserError when it is missing or not UTF-8."""
    return read_text(path, "--texts", limit=CAPTIONS_BYTES, error=UserError).splitlines()


def _read_summary(path: Path) -> dict:
    """The settings an earlier run recorded in embed.json; UserError when the file is damaged."""
    try:
        settings = read_json(path, "embed summary", path.parent, expect=dict, error=ValueError).get("settings")
    except ValueError:  # not JSON, not UTF-8, not an object, a FIFO
        settings = None
    if not isinstance(settings, dict):
        raise UserError(f"{path} is damaged (no settings object); remove the folder's embeddings or choose another --out")
    return settings


def embed(model_source, out, images: Optional[str] = None, texts: Optional[str] = None, flat: bool = False,
          image_key: str = "filepath", batch_size: int = 256, shard_size: int = SHARD_SIZE, num_workers: int = 2,
          device: str = "cpu", progress: bool = True) -> dict:
    """`topoclip embed`: embed the images and/or the texts (a file, one per line) into shards under `out`."""
    from topoclip.io.convert.files import weights_file
    from topoclip.run.inference import load
    from topoclip.core.atomic import write_text_atomic
    from topoclip.core.locks import claim_folder

    if not (images or texts):
        raise UserError("say what to embed: --images (a folder, CSV or shards) and/or --texts (a file, one per line)")
    if batch_size < 1 or shard_size < 1 or num_workers < 0:
        raise UserError(f"--batch-size {batch_size} and --shard-size {shard_size} must be ≥ 1, --workers {num_workers} ≥ 0")
    clip = load(model_source, device=device)
    if flat:
        try:
            require_flat(clip.model.config.topology)
        except ValueError as error:
            raise UserError(f"--flat: {error}") from None
    out = Path(out)
    summary_path = out / SUMMARY
    lines = _read_texts(texts) if texts else None
    with claim_folder(out, "embedding folder"):
        inputs = list_images(images, image_key) if images else None
        # What the shards were made from: a resume against other weights or another listing would mix two
        # models' vectors, or write rows under shard numbers that now mean other inputs.
        settings = {"model": str(model_source), "flat": flat, "shard_size": shard_size, "images": images,
                    "texts": texts, "weights_sha256": sha256_file(weights_file(clip.checkpoint)) if clip.checkpoint else None,
                    "images_sha256": _sha256_lines([item.key for item in inputs]) if images else None,
                    "texts_sha256": _sha256_lines(lines) if texts else None}
        if summary_path.exists():
            before = _read_summary(summary_path)
            changed = [key for key, value in settings.items() if before.get(key) != value]
            changed = [CHANGES.get(key, key) for key in changed  # a hash says more only where its source is the same
                       if not (key.endswith("_sha256") and key.removesuffix("_sha256") in changed)]
            if changed:
                raise UserError(f"{out} holds embeddings made with other settings ({', '.join(changed)}); resume "
                                f"with the same ones, or choose another --out")
        write_text_atomic(summary_path, json.dumps({"settings": settings}, indent=2))
        # What scores the vectors: the topology, and a hyperbolic model's learned c (its points are space components).
        summary = {"settings": settings, "shape": list(clip.model.embedding_shape), "topology": clip.model.config.topology,
                   **({"curvature": clip.model.curvature_value.item()} if clip.model.curvature is not None else {})}
        if images:
            summary["images"] = embed_images(clip, inputs, out, flat, batch_size, shard_size, num_workers, progress)
        if texts:
            summary["texts"] = embed_texts(clip, lines, out, flat, batch_size, shard_size, progress)
        write_text_atomic(summary_path, json.dumps(summary, indent=2))
    return summary
