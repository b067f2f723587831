"""Data a user brings, made for the tests of tests/data/: images in every awkward and broken encoding, caption
tables and tar shards that hold every kind of bad sample, and the collector that counts what a loader let through."""
import io
import struct
import tarfile
import zlib

import numpy as np
import torch
from PIL import Image

from topoclip.data.batch import RawBatch
from topoclip.data.quality import BadSampleCounter
from topoclip.data.shard_writer import shard_pattern, write_shards
from topoclip.preprocess.transforms import eval_transform

SIZE = 16
TRANSFORM = eval_transform(SIZE, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))  # pixel values stay in [0, 1]

# ---------------------------------------------------------------------------------------------------
# Test images, encoded


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def noise(height, width, seed=0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def png_claiming_size(width, height) -> bytes:
    """A PNG whose header claims width x height but holds almost no data (a decompression bomb's header)."""

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def scene_samples(count: int, offset: int = 0) -> list[tuple[bytes, str]]:
    """(PNG bytes, caption) of built-in training scenes offset .. offset + count - 1."""
    from topoclip.data.scenes import SceneConfig, SceneDataset

    scenes = SceneDataset(SceneConfig(train_size=offset + count), "train")
    return [(encode(Image.fromarray(scenes[i][0]), "PNG"), scenes[i][1]) for i in range(offset, offset + count)]


def good_images() -> dict:
    """name -> (encoded bytes, extension): decodable images in awkward formats."""
    rgba = Image.new("RGBA", (12, 10), (255, 0, 0, 255))
    rgba.putpixel((0, 0), (0, 0, 0, 0))  # fully transparent black: must come out white
    palette = Image.new("P", (8, 8), 0)
    palette.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    palette.putpixel((1, 1), 1)
    sixteen = Image.fromarray(np.array([[0, 257 * 128], [65535, 257 * 200]], dtype=np.uint16))
    return {
        "rgb_jpeg": (encode(noise(20, 30, 1), "JPEG"), "jpg"),
        "cmyk_jpeg": (encode(Image.new("CMYK", (20, 20), (0, 255, 255, 0)), "JPEG"), "jpg"),
        "grey_png": (encode(noise(20, 20, 2).convert("L"), "PNG"), "png"),
        "grey_alpha_png": (encode(noise(20, 20, 3).convert("LA"), "PNG"), "png"),
        "one_bit_png": (encode(noise(20, 20, 4).convert("1"), "PNG"), "png"),
        "rgba_png": (encode(rgba, "PNG"), "png"),
        "palette_transparent_png": (encode(palette, "PNG", transparency=0), "png"),
        "sixteen_bit_png": (encode(sixteen, "PNG"), "png"),
        "webp": (encode(noise(20, 20, 5), "WEBP"), "webp"),
        "wide_20000x4_png": (encode(Image.new("RGB", (20000, 4), (0, 128, 255)), "PNG"), "png"),
    }


def bad_images() -> dict:
    """name -> (encoded bytes, extension, expected kind)."""
    jpeg = encode(noise(64, 64, 6), "JPEG")
    return {
        "truncated_jpeg": (jpeg[: len(jpeg) // 2], "jpg", "corrupt_image"),
        "random_bytes": (np.random.default_rng(7).bytes(500), "jpg", "corrupt_image"),
        "one_by_one": (encode(Image.new("RGB", (1, 1)), "PNG"), "png", "tiny_image"),
        "bomb_header": (png_claiming_size(30000, 30000), "png", "huge_image"),
    }

# ---------------------------------------------------------------------------------------------------
# Counting and the threshold


def collect(batches):
    """(captions in order, BadSampleCounter, image shapes) over an iterable of RawBatch."""
    captions, counter = [], BadSampleCounter()
    for batch in batches:
        assert isinstance(batch, RawBatch)
        assert batch.images.shape[0] == len(batch.captions)
        if len(batch):
            assert batch.images.shape[1:] == (3, SIZE, SIZE) and batch.images.dtype == torch.float32
        captions.extend(batch.captions)
        counter += batch
    return captions, counter

# ---------------------------------------------------------------------------------------------------
# CSV / TSV


def write_caption_table(folder, separator=b","):
    """A table over every good and bad image plus bad captions; returns (path, good captions, bad counts).

    The table and its images are in folder/data; two rows name a real image outside it (folder/outside.png,
    by "../" and by absolute path): "path_outside_root" unless the reader allows outside paths.
    """
    folder = folder / "data"
    (folder / "images").mkdir(parents=True)
    outside = folder.parent / "outside.png"
    outside.write_bytes(encode(noise(20, 20, 8), "PNG"))
    lines = [b"title" + separator + b"filepath" + separator + b"extra"]
    good, expected = [], {}
    for name, (data, extension) in good_images().items():
        (folder / "images" / f"{name}.{extension}").write_bytes(data)
        caption = f"good {name}"
        lines.append(caption.encode() + separator + f"images/{name}.{extension}".encode() + separator + b"x")
        good.append(caption)
    absolute = folder / "images" / "absolute.png"
    absolute.write_bytes(encode(noise(20, 20, 9), "PNG"))
    lines.append(b"good absolute" + separator + str(absolute).encode() + separator + b"x")  # inside: allowed
    good.append("good absolute")
    lines.append(b"outside relative" + separator + b"../outside.png" + separator + b"x")
    lines.append(b"outside absolute" + separator + str(outside).encode() + separator + b"x")
    for name, (data, extension, kind) in bad_images().items():
        (folder / "images" / f"{name}.{extension}").write_bytes(data)
        lines.append(f"bad {name}".encode() + separator + f"images/{name}.{extension}".encode() + separator + b"x")
        expected[kind] = expected.get(kind, 0) + 1
    ok_image = b"images/rgb_jpeg.jpg"
    lines.append(b"bad missing" + separator + b"images/not_there.jpg" + separator + b"x")
    lines.append(b"   " + separator + ok_image + separator + b"x")
    lines.append(b"caf\xe9 in latin-1" + separator + ok_image + separator + b"x")
    lines.append(b"")  # a blank line is not a sample
    lines.append(b"short row without image")  # no image column at all
    expected.update(missing_file=2, empty_caption=1, bad_encoding=1, path_outside_root=2)
    expected["corrupt_image"] = expected.get("corrupt_image", 0)
    path = folder / ("table.tsv" if separator == b"\t" else "table.csv")
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path, good, expected

# ---------------------------------------------------------------------------------------------------
# Tar shards


def add_member(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_broken_shards(folder):
    """Two shards holding every good image and every bad kind; returns (brace pattern, good, expected)."""
    samples, good, expected = [], [], {}
    for name, (data, _) in good_images().items():
        samples.append((data, f"good {name}"))
        good.append(f"good {name}")
    for name, (data, _, kind) in bad_images().items():
        samples.append((data, f"bad {name}"))
        expected[kind] = expected.get(kind, 0) + 1
    ok = good_images()["rgb_jpeg"][0]
    samples += [(ok, b" \n "), (ok, b"caf\xe9 latin-1")]
    expected.update(empty_caption=1, bad_encoding=1)
    paths = write_shards(samples, folder, samples_per_shard=8)
    with tarfile.open(paths[-1], "a") as tar:  # members without their pair
        add_member(tar, "lonely0001.jpg", ok)
        add_member(tar, "lonely0002.txt", b"a caption without an image")
    expected["unpaired_member"] = 2
    return shard_pattern(paths), good, expected, paths
