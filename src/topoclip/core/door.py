"""The one door for files a stranger can hand over: a run, model, checkpoint, ablation, cache, dataset or pool
folder, a preset or grid file, a Hub snapshot. Every such file is opened, read, listed and copied here.

What the door guarantees, whatever the file holds:
- **regular files only.** A FIFO would block a read forever, a device (``/dev/zero``) never end one, a socket fail
  it: each is opened without blocking (``O_NONBLOCK``), checked with ``fstat`` on the descriptor itself (no window
  between the check and the read) and refused.
- **links never lead out.** Given the folder it belongs to (``root``), a path is refused when it or any folder on
  the way resolves outside that folder (a planted ``seed-0 -> ~/data``, ``secret.txt -> /etc/hostname``). The root
  itself is the user's to place (a run folder may be a link to another disk), and a file named on the command line
  has no root: the user chose it.
- **bounded.** A size bound before anything is read (`size` below), a depth bound on JSON (`JSON_DEPTH`), a count
  bound on listings and copies (`ENTRIES`), each named in its refusal.
- **copies never follow links.** `copy_tree` copies regular files and folders; a link or a special file inside the
  source is refused before anything is written, and the copy lands whole (a scratch sibling, renamed) or not at all.

Each refusal is a `UserError` (or the `error` class a caller names, e.g. CheckpointError) of one line: what, where,
and the fix. tests/test_door.py fails when a module outside this one opens, reads, lists or copies a path itself
(the few that read only what topoclip wrote or shipped are listed there, each with its reason).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any, Callable, Optional, Union

from topoclip.core.atomic import scratch_folder
from topoclip.core.errors import DiskFullError, UserError

PathLike = Union[str, os.PathLike]

MiB = 1 << 20
# Size bounds, each far above what a real file of its kind holds and far below what would exhaust memory:
CONFIG_BYTES = 4 * MiB  # a settings file (config.json ~5 KB, eval.json ~50 KB, a landed ablation.json ~0.9 MB)
JSON_BYTES = 64 * MiB  # a tokenizer.json: the largest in use (Gemma's) is ~34 MB
TEXT_BYTES = 64 * MiB  # classnames, templates, a vocab.txt (BERT's: 230 KB), merges.txt (CLIP's: 525 KB)
CAPTIONS_BYTES = 256 * MiB  # a Karpathy caption file: COCO's dataset_coco.json is 151 MB
PICKLE_BYTES = 256 * MiB  # one CIFAR batch file is 31 MB (CIFAR-100's train file 155 MB)
IMAGE_BYTES = 256 * MiB  # one encoded image; PIL's own decompression-bomb bound then caps its pixels
# JSON nesting: no file topoclip reads nests more than ~6 deep (tokenizer.json); Python's parser would recurse
# ~1,000 deep before a RecursionError, and every reader after it recurses again.
JSON_DEPTH = 64
# Objects and lists in one JSON file, counted (as the "{" and "[" in its text, strings' included: an overcount)
# before it is parsed: each costs Python ~60 bytes, so a file of 64 MiB of "{}," would take 2.5 GB. COCO's Karpathy
# file holds ~1.5 M, a large tokenizer.json's merges ~0.3 M; 4 M cost at most ~250 MB.
JSON_CONTAINERS = 4_000_000
# Entries of one listed folder, or files of one copied tree: a run folder holds tens, a dataset folder of images
# hundreds of thousands.
ENTRIES = 2_000_000

_KINDS = {stat.S_IFREG: "a file", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder", stat.S_IFLNK: "a symbolic link"}


class FileRefused(UserError):
    """A file or folder the door will not open: a link out of its folder, not a regular file, past a bound."""


def kind(mode: int) -> str:
    """'a FIFO', 'a folder', ... for a stat mode that is not a regular file."""
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def size_text(size: int) -> str:
    return f"{size / MiB:,.1f} MiB" if size >= MiB else f"{size:,} bytes"


# --------------------------------------------------------------------------- where a path leads


def link_root(root: PathLike) -> Path:
    """The folder the links of `root` may lead into: `root` itself, or for a Hugging Face Hub snapshot
    (…/models--ORG--NAME/snapshots/REVISION, whose files are links into the repository's blobs/) that repository's
    cache folder."""
    root = Path(root)
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        return root.parent.parent
    return root


def escapes(path: PathLike, root: PathLike) -> Optional[str]:
    """Why `path` leaves `root` through a link (the first entry on the way that does), or None when it stays inside.

    `path` is `root` or below it, as the caller built it (root / "runs" / cell / ...). Each entry from `root` down is
    looked at without following it: a link is allowed only when what it points to is inside `root` too."""
    root, path = Path(root), Path(path)
    inside = os.path.realpath(link_root(root))
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        return f"{path} is not inside {root}"
    if ".." in parts:
        return f"{path} climbs out of {root} ('..')"
    current = root
    for part in parts:
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return None  # nothing further exists: nothing further can lead out
        if stat.S_ISLNK(mode):
            target = os.path.realpath(current)
            if os.path.commonpath([inside, target]) != inside:
                return f"{current} is a symbolic link to {target}, outside {root}"
    return None


def check_inside(path: PathLike, root: Optional[PathLike], what: str, error: type = FileRefused) -> Path:
    """`path`, or `error` when a link on the way from `root` leads out of it (see `escapes`); no root: the user's."""
    if root is not None:
        why = escapes(path, root)
        if why:
            raise error(f"{what}: {why}; topoclip never follows a link out of the folder it was given: replace the "
                        f"link with the file or folder itself")
    return Path(path)


# --------------------------------------------------------------------------- reading


def open_regular(path: PathLike, what: str, root: Optional[PathLike] = None, limit: Optional[int] = CONFIG_BYTES,
                 error: type = FileRefused) -> io.BufferedReader:
    """The open binary file at `path` (close it, or use it in a `with`), which must be a regular file (inside `root`,
    at most `limit` bytes; None: any size, read as a stream). FileNotFoundError when it does not exist, so that
    callers may treat it as absent."""
    check_inside(path, root, what, error)
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except IsADirectoryError:
        raise error(f"{what} {path} is a folder, not a file") from None
    except PermissionError:
        raise error(f"{what} {path} cannot be read (permission denied)") from None
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{what} {path} is {kind(info.st_mode)}, not a regular file; a FIFO or device would block or "
                        f"never end the read: replace it with the file itself")
        if limit is not None and info.st_size > limit:
            raise error(f"{what} {path} is {size_text(info.st_size)}, over the {size_text(limit)} such a file may be; "
                        f"it is not the file topoclip expects there")
        os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def read_bytes(path: PathLike, what: str, root: Optional[PathLike] = None, limit: int = CONFIG_BYTES,
               error: type = FileRefused) -> bytes:
    """The whole regular file (see `open_regular`), never more than `limit` bytes even if it grows meanwhile."""
    with open_regular(path, what, root, limit, error) as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        raise error(f"{what} {path} grew past {size_text(limit)} while it was read")
    return data


def read_text(path: PathLike, what: str, root: Optional[PathLike] = None, limit: int = TEXT_BYTES,
              errors: str = "strict", error: type = FileRefused) -> str:
    """The file as UTF-8 text; `error` when it is not UTF-8 (errors="strict")."""
    data = read_bytes(path, what, root, limit, error)
    try:
        return data.decode("utf-8", errors)
    except UnicodeDecodeError as problem:
        raise error(f"{what} {path} is not UTF-8 text (byte {problem.start}); save it as UTF-8") from None


def parse_json(text: Union[str, bytes], what: str, depth: int = JSON_DEPTH, error: type = FileRefused) -> Any:
    """JSON text -> value; `error` when it is not JSON, holds an integer of more digits than Python converts, or nests
    deeper than `depth` (checked after parsing, without recursion, so no later reader recurses into it), or holds more
    than JSON_CONTAINERS objects and lists (counted before parsing)."""
    opening = (b"{", b"[") if isinstance(text, bytes) else ("{", "[")
    containers = text.count(opening[0]) + text.count(opening[1])
    if containers > JSON_CONTAINERS:
        raise error(f"{what} holds {containers:,} objects and lists, over the {JSON_CONTAINERS:,} any file topoclip "
                    f"reads may have")
    try:
        value = json.loads(text)
    except RecursionError:
        raise error(f"{what} is not valid JSON (nested too deeply: deeper than Python can parse; no file topoclip "
                    f"reads nests more than {depth} levels)") from None
    except ValueError as problem:  # not JSON, not UTF-8, an integer of over 4,300 digits
        raise error(f"{what} is not valid JSON ({str(problem)[:160]})") from None
    level, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if level > depth:
            raise error(f"{what} is not valid JSON (nested too deeply: more than the {depth} levels any file "
                        f"topoclip reads may have)")
        if isinstance(item, dict):
            stack.extend((child, level + 1) for child in item.values() if isinstance(child, (dict, list)))
        elif isinstance(item, list):
            stack.extend((child, level + 1) for child in item if isinstance(child, (dict, list)))
    return value


def read_json(path: PathLike, what: str, root: Optional[PathLike] = None, limit: int = CONFIG_BYTES,
              depth: int = JSON_DEPTH, expect: Optional[type] = None, error: type = FileRefused) -> Any:
    """The JSON value of a regular file (bounded in size and depth); with `expect` (dict or list), `error` when the
    value is of another type."""
    value = parse_json(read_bytes(path, what, root, limit, error), f"{what} {path}", depth, error)
    if expect is not None and not isinstance(value, expect):
        names = {dict: "an object", list: "a list"}
        raise error(f"{what} {path} holds a JSON {type(value).__name__}, not {names.get(expect, expect.__name__)}")
    return value


def torch_archive(path: PathLike, what: str, root: Optional[PathLike] = None, error: type = FileRefused):
    """The open file of a torch.save archive (a regular file, see `open_regular`), for torch.load(weights_only=True):
    `error` when it is a zip (torch's format since 1.6) holding a compressed member. torch writes every member
    stored; a compressed one could inflate a small file into gigabytes before any check sees it. Stored members
    cost no more memory than the file's own size. (The legacy format, not a zip, reads its storages from the file.)"""
    import zipfile

    file = open_regular(path, what, root, None, error)
    try:
        if zipfile.is_zipfile(file):
            compressed = next((member.filename for member in zipfile.ZipFile(file).infolist()
                               if member.compress_type != zipfile.ZIP_STORED), None)
            if compressed:
                raise error(f"{what} {path} holds a compressed member ({compressed[:80]}), which torch.save never "
                            f"writes; it is not a file topoclip reads")
        file.seek(0)
        return file
    except BaseException:
        file.close()
        raise


def regular_file(path: PathLike, what: str, root: Optional[PathLike] = None, limit: Optional[int] = None,
                 error: type = FileRefused) -> Path:
    """`path` checked for a reader that takes a path (safetensors' memory map, tarfile, torch's zip reader): a regular
    file inside `root` of at most `limit` bytes. FileNotFoundError when it does not exist."""
    with open_regular(path, what, root, limit, error):
        return Path(path)


def is_regular(path: PathLike, root: Optional[PathLike] = None) -> bool:
    """Whether `path` is a regular file inside `root` (a link to one inside counts): a FIFO, a device, a folder or a
    link out is not. Never blocks, never raises."""
    try:
        if root is not None and escapes(path, root):
            return False
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def is_folder(path: PathLike, root: Optional[PathLike] = None) -> bool:
    """Whether `path` is a folder inside `root` (see `is_regular`)."""
    try:
        if root is not None and escapes(path, root):
            return False
        return stat.S_ISDIR(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


# --------------------------------------------------------------------------- listing


def list_folder(path: PathLike, what: str, root: Optional[PathLike] = None, limit: int = ENTRIES,
                error: type = FileRefused) -> list[os.DirEntry]:
    """The entries of a folder, sorted by name, links not followed (an entry's is_symlink() says so); `error` when
    the folder leads out of `root` or holds more than `limit` entries."""
    check_inside(path, root, what, error)
    entries = []
    with os.scandir(path) as found:
        for entry in found:
            entries.append(entry)
            if len(entries) > limit:
                raise error(f"{what} {path} holds more than {limit:,} entries; it is not the folder topoclip expects")
    return sorted(entries, key=lambda entry: entry.name)


def is_empty(path: PathLike) -> bool:
    """Whether the folder `path` holds nothing (one entry is read, however many there are)."""
    with os.scandir(path) as found:
        return next(found, None) is None


def walk(path: PathLike, what: str, limit: int = ENTRIES, error: type = FileRefused) -> list[tuple[Path, os.stat_result]]:
    """Every entry below `path` (folders before what they hold) with its own stat, links and special files refused
    (naming the first), at most `limit` entries."""
    found, pending = [], [Path(path)]
    while pending:
        folder = pending.pop()
        for entry in list_folder(folder, what, None, limit, error):
            info = entry.stat(follow_symlinks=False)
            if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
                target = f" to {os.readlink(entry.path)}" if stat.S_ISLNK(info.st_mode) else ""
                raise error(f"{what}: {entry.path} is {kind(info.st_mode)}{target}; topoclip copies and reads only "
                            f"files and folders: replace it with the file itself, or remove it")
            found.append((Path(entry.path), info))
            if len(found) > limit:
                raise error(f"{what} {path} holds more than {limit:,} files; it is not the folder topoclip expects")
            if stat.S_ISDIR(info.st_mode):
                pending.append(Path(entry.path))
    return found


def check_tree(path: PathLike, what: str, limit: int = ENTRIES, error: type = FileRefused) -> None:
    """`error` when the folder holds a link or a special file anywhere below it (see `walk`)."""
    walk(path, what, limit, error)


# --------------------------------------------------------------------------- copying and removing


def copy_tree(source: PathLike, destination: PathLike, what: str, ignore: Callable[[str], bool] = lambda name: False,
              limit: int = ENTRIES, error: type = FileRefused) -> None:
    """Copy the folder `source` to `destination` (which must not exist): regular files and folders only, every entry
    checked before anything is written (see `walk`; names `ignore` accepts left out), the bytes counted against the
    free disk; the copy lands whole (a scratch sibling, renamed) or not at all."""
    source, destination = Path(source), Path(destination)
    entries = [(p, info) for p, info in walk(source, what, limit, error)
               if not any(ignore(part) for part in p.relative_to(source).parts)]
    total = sum(info.st_size for _, info in entries if stat.S_ISREG(info.st_mode))
    destination.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(destination.parent).free
    if total > free:
        raise DiskFullError(f"copying {what} {source} needs {size_text(total)} but {destination.parent} has "
                            f"{size_text(free)} free; free some space", destination)
    with scratch_folder(destination, f"copying {what} {source} to {destination}") as scratch:
        for path, info in sorted(entries, key=lambda item: len(item[0].parts)):
            target = scratch / path.relative_to(source)
            if stat.S_ISDIR(info.st_mode):
                target.mkdir()
                continue
            with open_regular(path, what, source, None, error) as reader, open(target, "xb") as writer:
                shutil.copyfileobj(reader, writer, 1 * MiB)


def remove_tree(path: PathLike, root: PathLike, what: str, error: type = FileRefused) -> None:
    """Delete the folder `path` below `root` (absent: nothing to do); `error`, deleting nothing, when a link on the way
    from `root` leads elsewhere, or `path` itself is a link: the delete would land in someone else's folder."""
    path = Path(path)
    check_inside(path, root, what, error)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise error(f"{what} {path} is a symbolic link to {os.path.realpath(path)}; topoclip never deletes through a "
                    f"link: remove the link yourself, or use another folder")
    if not stat.S_ISDIR(mode):  # (rmtree would open a FIFO to list it, and wait for a writer forever)
        raise error(f"{what} {path} is {kind(mode)}, where a folder belongs; remove it yourself, or use another folder")
    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- digests


def sha256_file(path: PathLike, progress: bool = False) -> str:
    """The hex sha256 of a regular file's bytes (what a resumed writer checks its inputs against), read 1 MiB at a
    time; `progress`: a bar of the bytes read (a CSV of LAION's size takes minutes)."""
    from tqdm.auto import tqdm

    digest = hashlib.sha256()
    with open_regular(path, "file", limit=None) as file, tqdm(total=os.fstat(file.fileno()).st_size, unit="B",
                                                             unit_scale=True, desc=f"hash {os.path.basename(path)}",
                                                             disable=not progress) as bar:
        for block in iter(lambda: file.read(1 * MiB), b""):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()
