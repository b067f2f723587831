"""Evaluation sets in the field's layouts: CLIP_benchmark's WebDataset folders and CIFAR's binary files.

CLIP_benchmark's WebDataset layout (what `clip_benchmark_export_wds` writes, and the `wds/…` sets
it downloads from the Hugging Face Hub)::

    ROOT/classnames.txt                          one class name per line, in label order
    ROOT/zeroshot_classification_templates.txt   one template per line, "{c}" where the name goes
    ROOT/dataset_type.txt                        "retrieval" (absent or anything else: classification)
    ROOT/SPLIT/nshards.txt                       the number of shards N
    ROOT/SPLIT/0.tar … (N-1).tar                 samples: KEY.webp|png|jpg|jpeg and KEY.cls (the label)
                                                 or KEY.txt (captions, one per line)

Only local folders are read (a URL is refused: a config never makes topoclip fetch or run anything).
Samples are indexed once (tar member offsets; every image header checked) and decoded on access, so
a 50,000-image set costs its index, not its pixels. A sample with a corrupt image, no label or no
caption is skipped and counted, and reported in one warning.

CIFAR's binary version (cifar-10-batches-bin/test_batch.bin, cifar-100-binary/test.bin) is read as
bytes: each record is the label byte(s), then 3 × 32 × 32 pixel bytes, channel-major. Its Python version
(cifar-10-batches-py/test_batch, cifar-100-python/test: what torchvision and CLIP_benchmark download) is a
pickle, read by an unpickler that admits arrays of plain numbers, lists, bytes, strings and numbers only: a
pickle that names any other class or function is refused before anything in it runs, and an array is built from
its raw bytes by topoclip, not by the pickle (its dtype checked to be a plain number type first).
"""
from __future__ import annotations

import _codecs
import io
import os
import pickle
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from PIL import Image

from topoclip.data.folders import listed
from topoclip.core.door import IMAGE_BYTES, PICKLE_BYTES, is_folder, is_regular, list_folder, open_regular, read_bytes, read_text
from topoclip.data.images import MAX_CAPTION_CHARS, DecodeSettings, clean_caption, decode_image
from topoclip.data.quality import BadSample, BadSampleCounter
from topoclip.data.shards import MAX_SHARDS
from topoclip.data.types import ClassificationSet, RetrievalSet

WDS_CLASSNAMES = "classnames.txt"
WDS_TEMPLATES = "zeroshot_classification_templates.txt"
WDS_TYPE = "dataset_type.txt"
WDS_SHARD_COUNT = "nshards.txt"
WDS_IMAGE_EXTENSIONS = ("webp", "png", "jpg", "jpeg")  # CLIP_benchmark's, in its order of preference

CIFAR_BINARY = {"cifar10": ("test_batch.bin", 1), "cifar100": ("test.bin", 2)}  # file, label bytes (fine last)
CIFAR_PIXELS = 3 * 32 * 32
# The Python version: (folder torchvision downloads into, test file, its label key).
CIFAR_PYTHON = {"cifar10": ("cifar-10-batches-py", "test_batch", "labels"),
                "cifar100": ("cifar-100-python", "test", "fine_labels")}


def is_wds_folder(root) -> bool:
    """Whether `root` looks like a CLIP_benchmark WebDataset folder (a split with nshards.txt)."""
    root = Path(root)
    return is_folder(root) and any(is_regular(Path(child.path) / WDS_SHARD_COUNT, root)
                                   for child in list_folder(root, "CLIP_benchmark set", error=ValueError))


@dataclass(frozen=True)
class TarMember:
    """Where one member's bytes lie in a local tar file."""

    tar: Path
    offset: int
    size: int

    def read(self) -> bytes:
        with open_regular(self.tar, "shard", self.tar.parent.parent, None, ValueError) as file:  # as it was listed
            file.seek(self.offset)
            return file.read(self.size)


class TarImages(Sequence):
    """Images inside tar files, decoded on access: images[i] -> RGB PIL image; images[a:b] -> TarImages."""

    def __init__(self, members: Sequence[TarMember], decode: DecodeSettings = DecodeSettings()):
        self.members, self.decode = list(members), decode
        self.skipped = BadSampleCounter()

    def __len__(self) -> int:
        return len(self.members)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return TarImages(self.members[index], self.decode)
        return decode_image(self.members[index].read(), self.decode.min_size, self.decode.max_pixels)


def _samples(tar: Path) -> dict[str, dict[str, TarMember]]:
    """{key: {extension: member}} of one shard, grouped as webdataset does (key = name up to the first dot
    of its base name, extension = the rest, lower case)."""
    samples: dict[str, dict[str, TarMember]] = {}
    try:  # the file checked is the file listed: one handle, opened through the door
        with open_regular(tar, "shard", tar.parent.parent, None, ValueError) as file, \
                tarfile.open(fileobj=file, mode="r:") as archive:  # plain tar: listed, never extracted
            size = os.fstat(file.fileno()).st_size
            for info in archive:
                if not info.isfile():
                    continue
                if info.offset_data + info.size > size:
                    raise tarfile.ReadError(f"member {info.name} ends past the end of the file")
                folder, _, base = info.name.rpartition("/")
                stem, dot, extension = base.partition(".")
                if not dot or not stem:
                    continue
                key = f"{folder}/{stem}" if folder else stem
                samples.setdefault(key, {})[extension.lower()] = TarMember(tar, info.offset_data, info.size)
            end = archive.offset  # where the listing stopped: the end-of-archive blocks (zeros), or damage
            file.seek(end)
            if file.read(2 * tarfile.BLOCKSIZE).strip(b"\0"):  # tarfile takes a cut header for the end
                raise tarfile.ReadError(f"the listing stops at byte {end:,} of {size:,} on a damaged header")
    except (tarfile.TarError, EOFError) as error:
        raise ValueError(f"shard {tar} is not a readable tar ({error or type(error).__name__}; cut short or not a "
                         f"tar): download it again, or leave it out") from None
    return samples


def _header_ok(member: TarMember, decode: DecodeSettings, counter: BadSampleCounter) -> bool:
    """Checks one image's header (no pixels decoded) and its size limits; counts it as kept or bad."""
    try:
        with Image.open(io.BytesIO(member.read())) as image:
            width, height = image.size
    except Exception:  # PIL raises many types for bytes that are not an image
        counter.add("corrupt_image")
        return False
    if width * height > decode.max_pixels:
        counter.add("huge_image")
        return False
    if min(width, height) < decode.min_size:
        counter.add("tiny_image")
        return False
    counter.keep()
    return True


def _read_lines(path: Path, root: Path) -> list[str]:
    return [line.strip() for line in read_text(path, "CLIP_benchmark file", root, error=ValueError).splitlines()
            if line.strip()]


def wds_shard_count(root: Path, split: str) -> int:
    """The number of shards of a local CLIP_benchmark WebDataset folder's split (its SPLIT/nshards.txt);
    ValueError naming the splits there, or the count's range."""
    count_file = root / split / WDS_SHARD_COUNT
    if not count_file.exists():
        found = [child.name for child in list_folder(root, "CLIP_benchmark set", error=ValueError)
                 if is_regular(Path(child.path) / WDS_SHARD_COUNT, root)] if is_folder(root) else []
        raise ValueError(f"{root} has no split {split!r:.80} ({split:.80}/{WDS_SHARD_COUNT} is missing); splits found: "
                         f"{found[:10]}")
    text = read_text(count_file, "shard count", root, 100, "replace", ValueError).strip()
    shards = int(text) if text.isascii() and text.isdigit() else 0
    if not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"{count_file} must hold the number of shards, 1 … {MAX_SHARDS:,}, e.g. 1")
    return shards


def load_wds_set(root, split: str = "test", name: Optional[str] = None,
                 decode: DecodeSettings = DecodeSettings()):
    """A ClassificationSet or RetrievalSet (by dataset_type.txt) from a CLIP_benchmark WebDataset folder."""
    text = str(root)
    if "://" in text:
        raise ValueError(f"{text}: a URL; download the CLIP_benchmark set first (e.g. `huggingface-cli download "
                         f"--repo-type dataset clip-benchmark/wds_NAME --local-dir DIR`) and give the folder")
    root = Path(root)
    shards = wds_shard_count(root, split)
    tars = [root / split / f"{index}.tar" for index in range(shards)]
    missing = [tar.name for tar in tars if not tar.exists()]
    if missing:
        raise ValueError(f"{root / split}: {WDS_SHARD_COUNT} says {shards} shards but {missing[:5]} are missing")
    kind = (read_text(root / WDS_TYPE, "dataset type", root, 100, "replace", ValueError).strip().lower()
            if (root / WDS_TYPE).exists() else "classification")
    if kind == "multilabel":
        raise ValueError(f"{root}: multi-label sets (dataset_type.txt: multilabel, .npy labels) are not supported")
    retrieval = kind == "retrieval"

    counter, members, targets = BadSampleCounter(), [], []
    for tar in tars:
        for key, sample in _samples(tar).items():
            image = next((sample[ext] for ext in WDS_IMAGE_EXTENSIONS if ext in sample), None)
            target = sample.get("txt" if retrieval else "cls")
            if image is None or target is None:
                counter.add("unpaired_member")
                continue
            if image.size > IMAGE_BYTES:  # read whole below: a sparse shard can declare gigabytes
                counter.add("huge_image")
                continue
            if target.size > 4 * MAX_CAPTION_CHARS:  # a label or a few captions; read into memory only below this
                counter.add("long_caption")
                continue
            try:
                text = target.read().decode("utf-8")
            except UnicodeDecodeError:
                counter.add("bad_encoding")
                continue
            try:
                value = ([clean_caption(line) for line in text.splitlines() if line.strip()] if retrieval
                         else int(text.strip()))
            except (ValueError, BadSample):
                counter.add("empty_caption" if retrieval else "bad_label")
                continue
            if retrieval and not value:
                counter.add("empty_caption")
                continue
            if _header_ok(image, decode, counter):
                members.append(image)
                targets.append(value)
    what = f"CLIP_benchmark set {root} split {split!r}"
    images = listed(TarImages(members, decode), counter, what)
    name = name or f"wds/{root.name.removeprefix('wds_')}"  # as CLIP_benchmark names it: --dataset wds/NAME
    if retrieval:
        captions = [caption for texts in targets for caption in texts]
        owner = [index for index, texts in enumerate(targets) for _ in texts]
        return RetrievalSet(name, images, captions, torch.tensor(owner, dtype=torch.int64))
    if not (root / WDS_CLASSNAMES).exists():
        raise ValueError(f"{root} has no {WDS_CLASSNAMES}; zero-shot classification needs the class names")
    classnames = _read_lines(root / WDS_CLASSNAMES, root)
    templates_file = root / WDS_TEMPLATES
    templates = [line.replace("{c}", "{}") for line in _read_lines(templates_file, root)] if templates_file.exists() \
        else ["a photo of a {}."]
    if not templates:
        raise ValueError(f"{templates_file} holds no template; write one per line, e.g. 'a photo of a {{c}}.', or "
                         f"remove the file (then 'a photo of a {{c}}.' is used)")
    labels = torch.tensor(targets, dtype=torch.int64)
    if labels.min() < 0 or labels.max() >= len(classnames):
        raise ValueError(f"{what}: labels span [{int(labels.min())}, {int(labels.max())}] but {WDS_CLASSNAMES} "
                         f"has {len(classnames)} classes")
    return ClassificationSet(name, images, labels, classnames, templates)


def read_cifar_binary(root, benchmark: str) -> tuple[np.ndarray, torch.Tensor]:
    """(images (N, 32, 32, 3) uint8, labels (N,) int64) of CIFAR's binary test file under `root`."""
    file_name, label_bytes = CIFAR_BINARY[benchmark]
    path = Path(root) / file_name
    if not path.exists():
        raise ValueError(f"{root} has no {file_name}: give the binary version's folder (cifar-10-batches-bin, "
                         f"cifar-100-binary) or class folders named by the class names")
    raw = np.frombuffer(read_bytes(path, "CIFAR file", root, PICKLE_BYTES, ValueError), dtype=np.uint8)
    record = label_bytes + CIFAR_PIXELS
    if raw.size % record:
        raise ValueError(f"{path}: {raw.size} bytes is not a whole number of {record}-byte records; a truncated file?")
    records = raw.reshape(-1, record)
    images = records[:, label_bytes:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # channel-major -> (N, H, W, 3)
    return np.ascontiguousarray(images), torch.from_numpy(records[:, label_bytes - 1].astype(np.int64))


# The plain dtypes a CIFAR array may have (numpy's one-character kind + size); nothing with fields or objects.
PLAIN_DTYPES = frozenset({"u1", "i1", "i2", "i4", "i8", "u2", "u4", "u8", "f4", "f8", "b1"})


class _Dtype:
    """What a pickle's numpy.dtype(...) records; turned into a real dtype only when it is a PLAIN_DTYPES one."""

    def __init__(self, name="", align=False, copy=False):
        self.name, self.state = name, None

    def __setstate__(self, state):
        self.state = state


class _Array:
    """What a pickle's numpy array records (shape, _Dtype, raw bytes); built with np.frombuffer after the checks."""

    def __init__(self, *args):
        self.state = None

    def __setstate__(self, state):
        self.state = state


class _ArraysOnly(pickle.Unpickler):
    """An unpickler for CIFAR's Python files: dicts, lists, bytes, strings, numbers, and arrays of plain numbers.

    Nothing from the file reaches numpy while it is read: an array and its dtype are recorded (_Array, _Dtype) and
    built afterwards from their raw bytes with np.frombuffer, once the dtype is checked to be a plain number type
    (a dtype state with object fields, or flags that hide them, is refused instead of trusted). Every other global
    is refused, unrun; the bytes Python 3 writes through _codecs.encode are counted against a budget (a pickle may
    reference one large string many times)."""

    def __init__(self, file, budget: int, **options):
        super().__init__(file, **options)
        self.budget = budget

    def encode(self, text: str, encoding: str = "latin1") -> bytes:
        self.budget -= len(text)
        if self.budget < 0:
            raise pickle.UnpicklingError("it expands to more bytes than the file could hold")
        return _codecs.encode(text, encoding)

    def find_class(self, module: str, name: str):
        found = {("numpy.core.multiarray", "_reconstruct"): _Array, ("numpy._core.multiarray", "_reconstruct"): _Array,
                 ("numpy", "ndarray"): _Array, ("numpy", "dtype"): _Dtype, ("_codecs", "encode"): self.encode}
        if (module, name) in found:
            return found[(module, name)]
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not an array, a list, bytes or a string")


# CIFAR's batch is a dict of arrays and lists of numbers and bytes: two levels. A pickle may share one list between
# many places (its memo); deeper than this is no CIFAR file.
CIFAR_DEPTH = 8


def _arrays(value, built: dict, depth: int = 0):
    """`value` with every _Array built as a NumPy array of its plain dtype; ValueError for anything else. `built`
    (id -> result) converts an object the pickle shares between many places once, so a file of shared references
    nested n deep costs n steps, not 2^n."""
    if depth > CIFAR_DEPTH:
        raise ValueError(f"it nests deeper than {CIFAR_DEPTH} levels, which CIFAR never does")
    if isinstance(value, (dict, list, _Array)) and id(value) in built:
        return built[id(value)]
    if isinstance(value, dict):
        result = built[id(value)] = {}
        result.update({key: _arrays(item, built, depth + 1) for key, item in value.items()})
        return result
    if isinstance(value, list):
        result = built[id(value)] = []
        result.extend(_arrays(item, built, depth + 1) for item in value)
        return result
    if not isinstance(value, _Array):
        if isinstance(value, (_Dtype, tuple, set)):
            raise ValueError(f"it holds a {type(value).__name__} where CIFAR has data")
        return value
    state = value.state
    if not (isinstance(state, tuple) and len(state) == 5):
        raise ValueError("an array without its data")
    _, shape, dtype, fortran, raw = state
    if not (isinstance(dtype, _Dtype) and dtype.name in PLAIN_DTYPES and isinstance(raw, (bytes, bytearray))
            and isinstance(shape, tuple) and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise ValueError(f"an array of dtype {getattr(dtype, 'name', dtype)!r}, not plain numbers")
    order = dtype.state[1] if isinstance(dtype.state, tuple) and len(dtype.state) > 1 and dtype.state[1] in "<>|=" else "|"
    if isinstance(dtype.state, tuple) and len(dtype.state) > 4 and (dtype.state[3] is not None or dtype.state[4] is not None):
        raise ValueError("an array with record fields")
    kind = np.dtype(order.replace("|", "=") + dtype.name if dtype.name[1:] != "1" else dtype.name)
    if len(raw) != int(np.prod(shape)) * kind.itemsize:
        raise ValueError(f"an array of shape {shape} with {len(raw)} bytes")
    array = np.frombuffer(bytes(raw), dtype=kind).reshape(shape, order="F" if fortran else "C")
    built[id(value)] = np.array(array)  # its own, writable memory
    return built[id(value)]


def cifar_python_file(root, benchmark: str) -> Optional[Path]:
    """The Python version's test file under `root` (the version's own folder, or the folder holding it), or None."""
    folder, file_name, _ = CIFAR_PYTHON[benchmark]
    for candidate in (Path(root) / file_name, Path(root) / folder / file_name):
        if candidate.exists():  # a FIFO or a link out there is refused when it is read, not passed over
            return candidate
    return None


def read_cifar_python(root, benchmark: str) -> tuple[np.ndarray, torch.Tensor]:
    """(images (N, 32, 32, 3) uint8, labels (N,) int64) of CIFAR's Python-version test file under `root`."""
    path = cifar_python_file(root, benchmark)
    if path is None:
        folder, file_name, _ = CIFAR_PYTHON[benchmark]
        raise ValueError(f"{root} has no {folder}/{file_name}: give the folder torchvision or CLIP_benchmark "
                         f"downloaded CIFAR into")
    label_key = CIFAR_PYTHON[benchmark][2]
    data = read_bytes(path, "CIFAR file", Path(root), PICKLE_BYTES, ValueError)
    try:
        batch = _arrays(_ArraysOnly(io.BytesIO(data), budget=2 * len(data), encoding="bytes").load(), {})
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            MemoryError, RecursionError) as error:
        raise ValueError(f"{path} is not CIFAR's Python version ({error}); download it again") from None
    if isinstance(batch, dict):  # the authors' Python 2 keys read as bytes; a file written by Python 3 has str keys
        batch = {key.decode("latin-1") if isinstance(key, bytes) else key: value for key, value in batch.items()}
    data = batch.get("data") if isinstance(batch, dict) else None
    labels = batch.get(label_key) if isinstance(batch, dict) else None
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2 and data.shape[1] == CIFAR_PIXELS
            and isinstance(labels, list) and len(labels) == len(data) and all(isinstance(v, int) for v in labels)):
        raise ValueError(f"{path} does not hold CIFAR's uint8 pixels (N, {CIFAR_PIXELS}) and {len(data) if isinstance(data, np.ndarray) else 'N'} "
                         f"integer labels under {label_key!r}; download it again")
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # channel-major -> (N, H, W, 3)
    return np.ascontiguousarray(images), torch.tensor(labels, dtype=torch.int64)
