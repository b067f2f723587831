"""Evaluation sets a user brings: class folders (zero-shot classification), Karpathy caption JSON and caption
tables (retrieval: a CSV / TSV of image path and caption, OpenCLIP's --val-data).

Images are decoded lazily, one per index, by `LazyImages`. When listing, each image's header is checked
(`verify=True`, cheap: no pixels decoded); missing or unreadable files are dropped, counted in
`images.skipped`, and reported in one warning. A file whose pixel data is broken beyond its header raises
BadSample naming the file when it is decoded.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Optional, Union

import torch

from topoclip.data.images import (DecodeSettings, check_image_header, clean_caption, decode_image, image_files,
                                  resolve_image_path)
from topoclip.data.quality import BadSample, BadSampleCounter
from topoclip.data.types import ClassificationSet, RetrievalSet
from topoclip.core.door import CAPTIONS_BYTES, is_folder, list_folder, parse_json, read_json, read_text

DEFAULT_TEMPLATES = ["a photo of a {}."]


class LazyImages(Sequence):
    """N image files decoded on access: images[i] -> RGB PIL image; images[a:b] -> LazyImages."""

    def __init__(self, paths: Sequence[Union[str, Path]], decode: DecodeSettings = DecodeSettings()):
        self.paths = [Path(path) for path in paths]
        self.decode = decode
        self.skipped = BadSampleCounter()  # files dropped while listing

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return LazyImages(self.paths[index], self.decode)
        return decode_image(self.paths[index], **dataclasses.asdict(self.decode))

    def __repr__(self) -> str:
        return f"LazyImages({len(self)} files)"


def _usable(path: Path, decode: DecodeSettings, counter: BadSampleCounter) -> bool:
    """Header check of one listed file; counts it as kept or by its bad kind."""
    try:
        check_image_header(path, decode.min_size, decode.max_pixels)
    except BadSample as bad:
        counter.add(bad.kind)
        return False
    counter.keep()
    return True


def listed(images, counter: BadSampleCounter, what: str):
    """An evaluation set's usable images (a LazyImages, TarImages, ...) with the skipped ones counted in
    `images.skipped` and warned about; ValueError when none is usable."""
    if not len(images):
        raise ValueError(f"{what} has no usable image ({counter.describe()})")
    if counter.bad_total:
        warnings.warn(f"{what}: {counter.describe()}")
    images.skipped = counter
    return images


def _listed_images(paths: list[Path], decode: DecodeSettings, counter: BadSampleCounter, what: str) -> LazyImages:
    """The usable files of an evaluation set, with the skipped ones counted (and warned about)."""
    return listed(LazyImages(paths, decode), counter, what)


def read_classnames(path: Union[str, Path], folders: list[str]) -> list[str]:
    """Class names for sorted `folders`: a text file with one name per line in that order, or JSON.

    JSON may be {folder: name} (must cover every folder) or a list of names in folder order.
    """
    path = Path(path)
    text = read_text(path, "class names file", error=ValueError)
    if path.suffix.lower() == ".json":
        data = parse_json(text, str(path), error=ValueError)
        if not isinstance(data, (dict, list)):
            raise ValueError(f"{path} holds a JSON {type(data).__name__}; give a list of names or a {{folder: name}}")
        if isinstance(data, dict):
            missing = [folder for folder in folders if folder not in data]
            if missing:
                raise ValueError(f"{path} names no class for folders {missing[:10]} ({len(missing)} missing)")
            return [str(data[folder]) for folder in folders]
        names = [str(name) for name in data]
    else:
        names = [line.strip() for line in text.splitlines() if line.strip()]
    if len(names) != len(folders):
        raise ValueError(
            f"{path} has {len(names)} class names but there are {len(folders)} class folders "
            f"({', '.join(folders[:5])}{', ...' if len(folders) > 5 else ''}); give one name per line in "
            "sorted folder order, or a JSON {folder: name}"
        )
    return names


def read_templates(path: Union[str, Path]) -> list[str]:
    """Prompt templates, one per line, each with one "{}" where the class name goes; blank lines ignored."""
    path = Path(path)
    templates = []
    for number, line in enumerate(read_text(path, "templates file", error=ValueError).splitlines(), start=1):
        template = line.strip()
        if not template:
            continue
        if template.count("{}") != 1:
            raise ValueError(f"{path} line {number}: a template needs exactly one '{{}}' for the class name: {line!r}")
        templates.append(template)
    if not templates:
        raise ValueError(f"{path} holds no templates; write one per line, e.g. 'a photo of a {{}}.'")
    return templates


def load_class_folders(
    root: Union[str, Path],
    classnames_file: Union[str, Path, None] = None,
    templates_file: Union[str, Path, None] = None,
    name: Optional[str] = None,
    verify: bool = True,
    decode: DecodeSettings = DecodeSettings(),
) -> ClassificationSet:
    """ClassificationSet from `root/<class folder>/**/<image>`: classes are the sorted subfolders.

    Class names default to the folder names with "_" read as spaces; labels (N,) index sorted folders.
    """
    root = Path(root)
    folders = class_folders(root)
    if classnames_file is not None:
        classnames = read_classnames(classnames_file, folders)
    else:
        classnames = [folder.replace("_", " ") for folder in folders]
    templates = read_templates(templates_file) if templates_file is not None else list(DEFAULT_TEMPLATES)

    images, labels = folder_images(root, list(enumerate(folders)), verify, decode)
    return ClassificationSet(name=name or root.name, images=images, labels=labels, classnames=classnames,
                             templates=templates)


def class_folders(root: Union[str, Path]) -> list[str]:
    """The sorted class subfolders of `root` (hidden ones left out); ValueError when there are none."""
    root = Path(root)
    if not is_folder(root):
        raise FileNotFoundError(f"class-folder root {root} is not a folder")
    folders = [entry.name for entry in list_folder(root, "class-folder root", error=ValueError)
               if is_folder(entry.path, root) and not entry.name.startswith(".")]
    if not folders:
        raise ValueError(f"{root} has no class subfolders; expected root/<class name>/<images>")
    return folders


def folder_images(root: Path, labelled: list[tuple[int, str]], verify: bool = True,
                  decode: DecodeSettings = DecodeSettings()) -> tuple[LazyImages, torch.Tensor]:
    """The usable images under each (label, folder) of `root`, and their labels (N,) int64."""
    paths, labels = [], []
    counter = BadSampleCounter()
    for label, folder in labelled:
        outside = []
        files = image_files(root / folder, outside)
        counter.add("path_outside_root", len(outside))  # links out of the class folder: never followed
        for path in files:
            if not verify or _usable(path, decode, counter):
                paths.append(path)
                labels.append(label)
    return _listed_images(paths, decode, counter, f"class folders {root}"), torch.tensor(labels, dtype=torch.int64)


def load_karpathy_captions(
    json_path: Union[str, Path],
    image_root: Union[str, Path],
    split: str = "test",
    name: Optional[str] = None,
    verify: bool = True,
    decode: DecodeSettings = DecodeSettings(),
) -> RetrievalSet:
    """RetrievalSet from a Karpathy-split JSON: {"images": [{"filename", "filepath"?, "split", "sentences"}]}.

    An image's file is image_root/filepath/filename (filepath, as in COCO's "val2014", is optional); a
    path that is absolute or leads out of image_root ("../outside/x.png") is never opened: the image is
    dropped and counted as "path_outside_root". Captions are each sentence's "raw" text (else its
    "tokens" joined). Empty captions are skipped and counted; an image left with no caption, or whose
    file is missing or unreadable, is dropped.
    """
    json_path, image_root = Path(json_path), Path(image_root)
    data = read_json(json_path, "Karpathy caption file", limit=CAPTIONS_BYTES, error=ValueError)
    entries = data.get("images") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{json_path} is not a Karpathy caption file: expected {{'images': [...]}}")
    entries = [entry for entry in entries if isinstance(entry, dict)]
    chosen = [entry for entry in entries if entry.get("split") == split]
    if not chosen:
        splits = sorted({str(entry.get("split")) for entry in entries})
        raise ValueError(f"{json_path} has no images in split {split!r}; splits found: {splits}")

    paths, captions, caption_image = [], [], []
    counter = BadSampleCounter()
    for entry in chosen:
        texts = []
        sentences = entry.get("sentences", [])
        for sentence in sentences if isinstance(sentences, list) else []:
            raw = sentence.get("raw") if isinstance(sentence, dict) else None
            if raw is None and isinstance(sentence, dict) and isinstance(sentence.get("tokens"), list):
                raw = " ".join(map(str, sentence["tokens"]))
            try:
                texts.append(clean_caption(raw))
            except BadSample as bad:
                counter.add(bad.kind)
        if not texts:
            continue
        folder, filename = entry.get("filepath", ""), entry.get("filename")
        try:
            if not isinstance(folder, str) or not isinstance(filename, str) or not filename.strip():
                raise BadSample("missing_file", f"entry {entry.get('imgid', '?')} has no file name")
            path = resolve_image_path(str(Path(folder) / filename), image_root)
        except BadSample as bad:
            counter.add(bad.kind)
            continue
        if verify and not _usable(path, decode, counter):
            continue
        captions.extend(texts)
        caption_image.extend([len(paths)] * len(texts))
        paths.append(path)
    return RetrievalSet(
        name=name or f"{json_path.stem}-{split}",
        images=_listed_images(paths, decode, counter, f"caption file {json_path} split {split!r} (images with a caption)"),
        captions=captions,
        caption_image=torch.tensor(caption_image, dtype=torch.int64),
    )


CAPTION_TABLE_SUFFIXES = (".csv", ".tsv", ".tab")  # a retrieval set read as a caption table, not a Karpathy JSON


def load_caption_table(
    path: Union[str, Path],
    image_key: str = "filepath",
    caption_key: str = "title",
    separator: Optional[str] = None,
    name: Optional[str] = None,
    allow_outside: bool = False,
    verify: bool = True,
    decode: DecodeSettings = DecodeSettings(),
) -> RetrievalSet:
    """RetrievalSet from a caption table (topoclip.data.csv.CaptionTable: OpenCLIP's --val-data CSV, paths relative to
    its folder): every row a pair, the rows of one image file its captions (in their order), the images in the
    order of their first row. The whole table is the set (a table has no split). Rows are checked as training
    checks them: an empty caption is skipped and counted, a path outside the table's folder (unless
    `allow_outside`) or a missing or unreadable file drops its image."""
    from topoclip.data.csv import SETTINGS, CaptionTable

    path = Path(path)
    index_of: dict[str, int] = {}
    paths, captions, caption_image = [], [], []
    counter = BadSampleCounter()
    dropped: set[str] = set()  # written paths already found unusable: counted once, their other rows skipped
    names = {**SETTINGS, "path": "setting evaluate.retrieval, OpenCLIP's --val-data"}  # (not the training table's)
    for written, raw in CaptionTable(path, image_key, caption_key, separator, names):
        if written in dropped:
            continue
        try:
            text = clean_caption(raw)
            image = resolve_image_path(written, path.parent, allow_outside)
        except BadSample as bad:
            counter.add(bad.kind)
            if bad.kind in ("path_outside_root", "missing_file"):
                dropped.add(written)
            continue
        key = os.path.abspath(image)  # one file however it is written (outside paths, when allowed, are not rewritten)
        if key not in index_of:
            if verify and not _usable(image, decode, counter):
                dropped.add(written)
                continue
            index_of[key] = len(paths)
            paths.append(image)
        captions.append(text)
        caption_image.append(index_of[key])
    return RetrievalSet(
        name=name or path.stem,
        images=_listed_images(paths, decode, counter, f"caption table {path} (images with a caption)"),
        captions=captions,
        caption_image=torch.tensor(caption_image, dtype=torch.int64),
    )
