"""The field's zero-shot benchmarks by name, and the evaluation sets a user names in the config.

`evaluate.classification` entries (also `topoclip train --imagenet-val PATH`):

- ``"PATH"``: class folders ``PATH/<class>/<images>``; optional ``classnames.txt`` and ``templates.txt``
  beside them; or a CLIP_benchmark WebDataset folder (``PATH/test/nshards.txt``; see
  topoclip.data.benchmark_sets), classification or retrieval by its ``dataset_type.txt``;
- ``"NAME=PATH"`` with NAME in BENCHMARKS: the benchmark's class names and prompt templates, shipped
  in ``evaluation/benchmark_data/NAME.json`` (the source of each list is written in the file):

  - ``imagenet1k``: the 1,000 class names and the 80 templates of CLIP's paper; PATH holds
    synset folders (``n01440764/…``, the ILSVRC-2012 validation layout OpenCLIP's ``--imagenet-val``
    reads), or a ``val/`` folder of them. The classifier always spans all 1,000 classes, as
    OpenCLIP's and CLIP_benchmark's do, so a subset of the folders gives numbers on the same scale.
  - ``cifar10`` / ``cifar100``: CLIP_benchmark's class names (torchvision's labels, as the dataset's
    meta file writes them) and its 18 templates (CLIP's ``data/prompts.md``), so a result file named
    after CLIP_benchmark's set holds CLIP_benchmark's prompts; PATH is the Python version's folder as
    torchvision and CLIP_benchmark download it (``cifar-10-batches-py``, ``cifar-100-python``, or the
    folder holding it), the binary version's (``cifar-10-batches-bin``, ``cifar-100-binary``), or
    class folders named by the class names ("_" and " " read alike).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Optional, Union

from topoclip.data.types import ClassificationSet, RetrievalSet

BENCHMARKS = ("imagenet1k", "cifar10", "cifar100")

# In a class-folder evaluation set: one class name per line (sorted folder order), one template per line.
CLASSNAMES_FILE = "classnames.txt"
TEMPLATES_FILE = "templates.txt"


@dataclass(frozen=True)
class Benchmark:
    """A benchmark's class names (label order), prompt templates ("{}" for the name) and, for ImageNet,
    the WordNet id of each class (its folder name in the standard layout)."""

    name: str
    classnames: tuple[str, ...]
    templates: tuple[str, ...]
    synsets: tuple[str, ...] = ()
    source: str = ""


@lru_cache(maxsize=None)
def get_benchmark(name: str) -> Benchmark:
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; choose one of {list(BENCHMARKS)}")
    data = json.loads(resources.files("topoclip.run.evaluation").joinpath("benchmark_data", f"{name}.json").read_text())
    return Benchmark(name, tuple(data["classnames"]), tuple(data["templates"]), tuple(data.get("synsets", ())),
                     data["source"])


def split_entry(entry: str) -> tuple[Optional[str], Path]:
    """"imagenet1k=PATH" -> ("imagenet1k", PATH); a plain path (even one holding "=") -> (None, path)."""
    name, separator, path = entry.partition("=")
    if separator and name in BENCHMARKS:
        return name, Path(path)
    return None, Path(entry)


def load_classification_entry(entry: str, split: str = "test") -> Union[ClassificationSet, RetrievalSet]:
    """The evaluation set an `evaluate.classification` entry names (see the module docstring).

    ValueError / FileNotFoundError (naming the file and what is wrong) when it cannot be read.
    """
    from topoclip.data.benchmark_sets import is_wds_folder, load_wds_set
    from topoclip.data.folders import load_class_folders

    name, root = split_entry(entry)
    if name is not None:
        return load_benchmark_set(get_benchmark(name), root)
    if is_wds_folder(root):
        return load_wds_set(root, split)
    names, templates = root / CLASSNAMES_FILE, root / TEMPLATES_FILE
    return load_class_folders(root, names if names.is_file() else None, templates if templates.is_file() else None)


def load_benchmark_set(benchmark: Benchmark, root: Path) -> ClassificationSet:
    """A named benchmark's images under `root`, labelled by their index in the benchmark's class list."""
    from topoclip.data.benchmark_sets import (CIFAR_BINARY, cifar_python_file, read_cifar_binary,
                                              read_cifar_python)
    from topoclip.data.folders import class_folders, folder_images

    if not root.is_dir():
        raise FileNotFoundError(f"{benchmark.name}={root}: no such folder")
    templates, classnames = list(benchmark.templates), list(benchmark.classnames)
    if benchmark.name in CIFAR_BINARY:
        read = (read_cifar_binary if (root / CIFAR_BINARY[benchmark.name][0]).is_file() else
                read_cifar_python if cifar_python_file(root, benchmark.name) else None)
        if read is not None:
            images, labels = read(root, benchmark.name)
            if len(labels) and not 0 <= int(labels.min()) <= int(labels.max()) < len(classnames):
                raise ValueError(f"{benchmark.name}={root}: labels outside 0 … {len(classnames) - 1}; not {benchmark.name}")
            return ClassificationSet(benchmark.name, images, labels, classnames, templates)
    if benchmark.synsets and not (root / benchmark.synsets[0]).is_dir() and (root / "val").is_dir():
        root = root / "val"
    keys = benchmark.synsets or tuple(name.replace(" ", "_") for name in classnames)
    index = {key: label for label, key in enumerate(keys)}
    folders = class_folders(root)
    unknown = [folder for folder in folders if folder.replace(" ", "_") not in index]
    if unknown:
        expected = "WordNet ids such as n01440764" if benchmark.synsets else f"class names such as {keys[0]!r}"
        raise ValueError(f"{benchmark.name}={root}: {len(unknown)} folder(s) are not {benchmark.name} classes "
                         f"({', '.join(unknown[:5])}); expected {expected}")
    images, labels = folder_images(root, [(index[folder.replace(" ", "_")], folder) for folder in folders])
    return ClassificationSet(benchmark.name, images, labels, classnames, templates)
