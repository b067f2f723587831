"""Decoding one user sample: image bytes or file -> RGB PIL image, caption bytes -> clean text.

Decisions, so every loader behaves the same way:
- Transparency (RGBA, LA, P or L with a transparent colour) is composited on white: transparent logos and
  line art are usually dark on transparent, and dropping alpha would show whatever colour the transparent
  pixels happen to store (often black on black).
- 16-bit greyscale (I;16 and friends) is scaled to 8 bit by value * 255 / 65535, not clipped at 255.
  32-bit integer ("I") images are scaled the same way when their largest value passes 255, else taken as
  8-bit; float ("F") images are taken as [0, 1] when their largest value is at most 1, else [0, 255].
- EXIF orientation is applied, so phone photos come out upright.
- A guard against decompression bombs: an image whose header claims more than `max_pixels` pixels is
  skipped as "huge_image" before any pixel is decoded. A very wide but small image (20000 x 4 = 80 kpx)
  is within the guard and is decoded normally; memory is bounded by the pixel count, not by a side.
- `draft_size`: the shorter side the caller needs. JPEGs are decoded at a reduced DCT scale (PIL `draft`,
  which never goes below the request) and any image whose shorter side is at least twice `draft_size` is
  box-reduced by an integer factor (PIL `reduce`), so large photos cost little time and memory.
- Only raster formats used for photos are opened (IMAGE_FORMATS); PIL's plugins that run external programs
  (EPS) or parse exotic containers are never reached.
"""
from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import Callable, Optional, Union

from PIL import Image, ImageOps

from topoclip.data.quality import BadSample
from topoclip.core.door import IMAGE_BYTES, escapes, is_regular, list_folder, open_regular
from topoclip.preprocess.transforms import TrainingCrop, to_rgb
from topoclip.preprocess.tokenizer import MAX_TEXT_CHARS

# The formats decode_image opens: what img2dataset, web crawls and evaluation sets contain.
IMAGE_FORMATS = ("JPEG", "MPO", "PNG", "WEBP", "GIF", "BMP", "TIFF", "PPM", "AVIF")
# File extensions (lower case, no dot) treated as images by the folder and shard loaders.
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff", "ppm", "pgm", "avif")

_CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


@dataclass(frozen=True)
class DecodeSettings:
    """Settings shared by every loader's image decoding (see decode_image)."""

    min_size: int = 2  # a shorter side below this is "tiny_image"
    max_pixels: int = 100_000_000  # more pixels than this is "huge_image" (decompression-bomb guard)
    draft_size: Optional[int] = None  # shorter side the caller needs; larger images are reduced toward it


def _available_formats() -> list[str]:
    Image.init()
    return [name for name in IMAGE_FORMATS if name in Image.OPEN]


def decode_image(
    data: Union[bytes, bytearray, memoryview, str, os.PathLike],
    min_size: int = 2,
    max_pixels: int = 100_000_000,
    draft_size: Optional[int] = None,
    plan: Optional[Callable[[int, int], Optional[tuple[int, int]]]] = None,
) -> Image.Image:
    """Decode encoded image bytes or an image file into an RGB PIL image (W, H).

    plan: called with the upright image's (width, height) once the header is read, before any pixel is decoded (a
    random crop draws its box there); returns the smallest upright (width, height) the caller needs, at which a JPEG
    is decoded at the reduced DCT scale that still holds it (None: full size). Raises BadSample with kind
    "missing_file", "corrupt_image", "tiny_image" or "huge_image".
    """
    if isinstance(data, (bytes, bytearray, memoryview)):
        source, name = BytesIO(bytes(data)), "image bytes"
    elif isinstance(data, (str, os.PathLike)):
        name = os.fspath(data)
        source = BytesIO(_read_image_file(name))
    else:
        raise TypeError(f"decode_image takes encoded bytes or a file path, got {type(data).__name__}")

    try:
        with warnings.catch_warnings():
            # The size check below replaces PIL's global MAX_IMAGE_PIXELS warning with a per-call setting.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(source, formats=_available_formats()) as image:
                width, height = image.size
                if width * height > max_pixels:
                    raise BadSample("huge_image", f"{name}: {width}x{height} pixels exceeds max_pixels {max_pixels}")
                if min(width, height) < min_size:
                    raise BadSample("tiny_image", f"{name}: {width}x{height}, a side is below min_size {min_size}")
                if plan is not None:
                    upright = _upright_size(image)
                    needed = plan(*upright)
                    if needed is not None and image.format in ("JPEG", "MPO"):
                        swapped = upright != (width, height)  # EXIF turns it a quarter: the stored sides swap
                        image.draft(None, needed[::-1] if swapped else needed)  # never below the size asked
                elif draft_size is not None and image.format in ("JPEG", "MPO"):
                    short = min(width, height)
                    if short > draft_size:
                        # Request the size whose shorter side is draft_size; draft never goes below it.
                        image.draft(None, (-(-draft_size * width // short), -(-draft_size * height // short)))
                image.load()
                image = _apply_exif_orientation(image)
                image = to_rgb(image)
    except BadSample:
        raise
    except Image.DecompressionBombError as error:
        raise BadSample("huge_image", f"{name}: {error}") from None
    except FileNotFoundError as error:
        raise BadSample("missing_file", f"{name}: {error}") from None
    except PermissionError as error:
        raise BadSample("missing_file", f"{name}: cannot be read ({error})") from None
    except MemoryError:
        raise
    except Exception as error:  # any decoder failure on untrusted bytes means the image is unusable
        raise BadSample("corrupt_image", f"{name}: {type(error).__name__}: {error}") from None

    if draft_size is not None:
        factor = min(image.size) // draft_size
        if factor >= 2:
            image = image.reduce(factor)  # box filter, keeps the shorter side >= draft_size
    return image


def check_image_header(
    path: Union[str, os.PathLike], min_size: int = 2, max_pixels: int = 100_000_000
) -> tuple[int, int]:
    """(width, height) of an image file from its header alone (no pixels decoded); cheap checks for a listing.

    Raises BadSample "missing_file", "corrupt_image" (not a readable image header), "tiny_image" or
    "huge_image". A file whose pixel data is truncated passes; decode_image catches that later.
    """
    name = os.fspath(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with _image_file(name) as file, Image.open(file, formats=_available_formats()) as image:
                width, height = image.size
    except BadSample:
        raise
    except Image.DecompressionBombError as error:
        raise BadSample("huge_image", f"{name}: {error}") from None
    except PermissionError as error:
        raise BadSample("missing_file", f"{name}: cannot be read ({error})") from None
    except MemoryError:
        raise
    except Exception as error:
        raise BadSample("corrupt_image", f"{name}: {type(error).__name__}: {error}") from None
    if width * height > max_pixels:
        raise BadSample("huge_image", f"{name}: {width}x{height} pixels exceeds max_pixels {max_pixels}")
    if min(width, height) < min_size:
        raise BadSample("tiny_image", f"{name}: {width}x{height}, a side is below min_size {min_size}")
    return width, height


def decode_for(transform: Callable, data, decode: DecodeSettings):
    """`transform`'s output for one sample's image bytes or file. A TrainingCrop draws its box from the header's size
    before any pixel is decoded, and a JPEG is decoded at the reduced DCT scale that still holds the box at the
    output's resolution (TrainingCrop.draw); any other transform gets the decoded RGB image."""
    if not isinstance(transform, TrainingCrop):
        return transform(decode_image(data, decode.min_size, decode.max_pixels, decode.draft_size))
    drawn = {}

    def plan(width: int, height: int) -> Optional[tuple[int, int]]:
        drawn["size"] = (width, height)
        drawn["box"], needed = transform.draw(width, height)
        return needed

    image = decode_image(data, decode.min_size, decode.max_pixels, plan=plan)
    return transform.cut(image, drawn["size"], drawn["box"])


def _upright_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) once EXIF orientation is applied (5–8 turn the image a quarter), from the header alone."""
    width, height = image.size
    try:
        orientation = image.getexif().get(0x0112, 1)
    except Exception:  # a broken EXIF block: _apply_exif_orientation leaves the image as stored
        orientation = 1
    return (height, width) if orientation in (5, 6, 7, 8) else (width, height)


def _apply_exif_orientation(image: Image.Image) -> Image.Image:
    """Rotate / flip per the EXIF orientation tag; a broken EXIF block leaves the image as stored."""
    try:
        return ImageOps.exif_transpose(image)
    except Exception:
        return image


# The longest caption read: far above any real one (the text context keeps its first few hundred characters),
# and a bound on what one sample's text costs the tokenizer (a 200 MB "caption" aborts its training).
MAX_CAPTION_CHARS = MAX_TEXT_CHARS


def clean_caption(raw: Union[bytes, bytearray, str, None]) -> str:
    """Caption text with control characters removed and whitespace runs collapsed to one space.

    Raises BadSample("bad_encoding") for bytes that are not UTF-8 (or a str holding undecodable bytes as
    surrogates, as `errors="surrogateescape"` produces), BadSample("empty_caption") for nothing left and
    BadSample("long_caption") past MAX_CAPTION_CHARS.
    """
    if raw is None:
        raise BadSample("empty_caption", "no caption")
    if isinstance(raw, (bytes, bytearray, memoryview, str)) and len(raw) > 4 * MAX_CAPTION_CHARS:  # not decoded:
        raise BadSample("long_caption", f"caption of {len(raw):,} bytes or characters")  # ≤ 4 bytes a character
    if isinstance(raw, (bytes, bytearray, memoryview)):
        try:
            text = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as error:
            raise BadSample("bad_encoding", f"caption is not UTF-8 ({error.reason} at byte {error.start})") from None
    elif isinstance(raw, str):
        text = raw
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise BadSample("bad_encoding", f"caption is not UTF-8 (undecodable byte at character {error.start})") from None
    else:
        raise TypeError(f"a caption must be str or bytes, got {type(raw).__name__}")
    text = " ".join(_CONTROL_CHARACTERS.sub(" ", text.replace("\ufeff", "")).split())
    if not text:
        raise BadSample("empty_caption", "caption is empty or only whitespace")
    if len(text) > MAX_CAPTION_CHARS:
        raise BadSample("long_caption", f"caption of {len(text):,} characters")
    return text


def image_files(folder: Union[str, Path], outside: Optional[list] = None) -> list[Path]:
    """Image files (by IMAGE_EXTENSIONS) under `folder`, recursively, in sorted order: listed through the door (a
    linked folder is not entered, so a loop of links cannot list forever; at most door.ENTRIES a folder). A file that
    is a link out of `folder` is left out (appended to `outside`, for the caller to count)."""
    found, pending, folder = [], [Path(folder)], Path(folder)
    while pending:
        current = pending.pop()
        for entry in list_folder(current, "image folder", error=ValueError):
            if entry.is_dir(follow_symlinks=False):
                pending.append(Path(entry.path))
            elif Path(entry.name).suffix[1:].lower() in IMAGE_EXTENSIONS and is_regular(entry.path):
                if entry.is_symlink() and escapes(entry.path, folder):
                    (outside if outside is not None else []).append(Path(entry.path))
                    continue
                found.append(Path(entry.path))
    return sorted(found)


class _NotAnImage(ValueError):
    """What the door says of an image file it will not open (a FIFO, a device, past IMAGE_BYTES)."""


def _image_file(name: str):
    """The open image file `name` (door.open_regular: a regular file); BadSample "missing_file" when it is absent,
    unreadable or not a regular file, "huge_image" past IMAGE_BYTES."""
    try:
        file = open_regular(name, "image", limit=None, error=_NotAnImage)
    except FileNotFoundError:
        raise BadSample("missing_file", f"{name} does not exist") from None
    except PermissionError as error:
        raise BadSample("missing_file", f"{name}: cannot be read ({error})") from None
    except _NotAnImage as error:
        raise BadSample("missing_file", str(error)) from None
    size = os.fstat(file.fileno()).st_size
    if size > IMAGE_BYTES:
        file.close()
        raise BadSample("huge_image", f"{name}: {size:,} bytes, over the {IMAGE_BYTES:,} an encoded image may be")
    return file


def _read_image_file(name: str) -> bytes:
    """The bytes of the image file `name` (see `_image_file`)."""
    with _image_file(name) as file:
        return file.read(IMAGE_BYTES + 1)


def resolve_image_path(written: str, root: Union[str, Path], allow_outside: bool = False) -> Path:
    """An image path as written in a table or caption file, joined to `root` (an absolute one replaces it).

    Unless `allow_outside`, the path must stay inside `root`: one that is absolute elsewhere, starts
    with "~" or climbs out with ".." raises BadSample("path_outside_root"), so a data or caption file
    cannot make topoclip read files elsewhere (e.g. "../../../../etc/passwd"). The check is on the path
    as written (normalised), and then on the links on the way: one that leads out of `root` is "path_outside_root"
    too (the door never follows a link out of the folder it was given); a link that stays inside is followed.
    """
    text = written.strip()
    if "\x00" in text:
        raise BadSample("missing_file", f"image path {text!r} contains a NUL character")
    joined = os.path.join(root, os.path.expanduser(text))
    if allow_outside:
        return Path(joined)
    base, absolute = os.path.abspath(root), os.path.abspath(joined)  # abspath normalises ".." lexically
    if os.path.commonpath([base, absolute]) != base:
        raise BadSample("path_outside_root", f"image path {text!r} leads outside {str(root)!r}")
    # The path checked is the path opened, root/… however it was written ("a/../b" is root/b; an absolute path inside
    # a relative root is root/its part below it), so one file is one path and the links below root are looked at.
    path = Path(os.path.normpath(os.path.join(root, os.path.relpath(absolute, base))))
    why = escapes(path, root)
    if why:  # a link on the way leads out: the door never follows one (allow_outside_paths does)
        raise BadSample("path_outside_root", why)
    return path
