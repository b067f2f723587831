"""Data a user brings: image decoding, caption cleaning, bad-sample counting, CSV, tar shards, eval folders.

Every loader is fed deliberately broken samples of every kind; the tests check exact counts per kind and
that every good sample comes through.
"""
import io
import json
import struct
import tarfile
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from topoclip.data.batch import RawBatch, assemble_batches
from topoclip.data.csv import CsvDataset, read_caption_table
from topoclip.data.folders import load_class_folders, load_karpathy_captions
from topoclip.data.images import clean_caption, decode_image, to_rgb
from topoclip.data.quality import (
    BAD_SAMPLE_KINDS,
    BadSample,
    BadSampleCounter,
    DataQualityError,
    check_bad_fraction,
)
from topoclip.data.shard_writer import csv_to_shards, shard_pattern, write_shards
from topoclip.data.shards import ShardDataset, expand_shard_sources, read_captions
from topoclip.transforms import ToTensor, eval_transform

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
# decode_image, clean_caption


@pytest.mark.parametrize("name", list(good_images()))
def test_decode_image_handles_awkward_formats(name):
    data, _ = good_images()[name]
    image = decode_image(data)
    assert image.mode == "RGB"
    assert min(image.size) >= 2


def test_decode_image_colour_decisions():
    images = good_images()
    rgba = np.asarray(decode_image(images["rgba_png"][0]))
    assert rgba[0, 0].tolist() == [255, 255, 255]  # transparent -> white
    assert rgba[5, 5].tolist() == [255, 0, 0]
    palette = np.asarray(decode_image(images["palette_transparent_png"][0]))
    assert palette[0, 0].tolist() == [255, 255, 255] and palette[1, 1].tolist() == [10, 200, 30]
    sixteen = np.asarray(decode_image(images["sixteen_bit_png"][0]))[..., 0]
    assert sixteen.tolist() == [[0, 128], [255, 200]]  # scaled by 255 / 65535, not clipped at 255
    cmyk = np.asarray(decode_image(images["cmyk_jpeg"][0])).astype(int)
    assert cmyk[10, 10, 0] > 200 and cmyk[10, 10, 1] < 60 and cmyk[10, 10, 2] < 60  # C=0 M=Y=255: red
    wide = decode_image(images["wide_20000x4_png"][0])
    assert wide.size == (20000, 4)
    assert TRANSFORM(wide).shape == (3, SIZE, SIZE)


@pytest.mark.parametrize("name", list(bad_images()))
def test_decode_image_raises_typed_bad_sample(name):
    data, _, kind = bad_images()[name]
    with pytest.raises(BadSample) as caught:
        decode_image(data)
    assert caught.value.kind == kind


def test_decode_image_limits_missing_file_and_exif(tmp_path):
    with pytest.raises(BadSample) as caught:
        decode_image(tmp_path / "nope.jpg")
    assert caught.value.kind == "missing_file"
    with pytest.raises(BadSample, match="huge_image"):
        decode_image(encode(noise(40, 40), "PNG"), max_pixels=1000)  # the setting, below PIL's own guard
    with pytest.raises(BadSample, match="tiny_image"):
        decode_image(encode(noise(3, 40), "PNG"), min_size=4)
    assert decode_image(encode(Image.new("RGB", (1, 1)), "PNG"), min_size=1).size == (1, 1)
    # EXIF orientation 6 (rotate 90 degrees clockwise): stored 30 x 10, shown 10 x 30.
    exif = Image.Exif()
    exif[0x0112] = 6
    rotated = decode_image(encode(noise(10, 30), "JPEG", exif=exif.tobytes()))
    assert rotated.size == (10, 30)


def test_decode_image_reduces_large_images_toward_draft_size():
    photo = encode(noise(400, 640, 8).resize((640, 400)), "JPEG")
    assert decode_image(photo).size == (640, 400)
    reduced = decode_image(photo, draft_size=64)
    assert 64 <= min(reduced.size) < 128 and abs(reduced.size[0] / reduced.size[1] - 1.6) < 0.05
    png = decode_image(encode(noise(300, 300), "PNG"), draft_size=100)  # no DCT draft: integer reduce
    assert png.size == (100, 100)


def test_to_rgb_of_32_bit_integer_images():
    assert np.asarray(to_rgb(Image.fromarray(np.array([[0, 65535]], dtype=np.int32), "I")))[0, 1, 0] == 255
    assert np.asarray(to_rgb(Image.fromarray(np.array([[0, 200]], dtype=np.int32), "I")))[0, 1, 0] == 200


def test_clean_caption():
    assert clean_caption(b"  a  dog\n on\tgrass \x00 ") == "a dog on grass"
    assert clean_caption("\ufeffcaf\u00e9") == "caf\u00e9"
    for empty in (b"", "   \n\t", None, "\x00\x01"):
        with pytest.raises(BadSample) as caught:
            clean_caption(empty)
        assert caught.value.kind == "empty_caption"
    for undecodable in (b"caf\xe9 latin-1", b"\xff\xfe\xfa", "caf\udce9"):  # last: surrogateescape'd byte
        with pytest.raises(BadSample) as caught:
            clean_caption(undecodable)
        assert caught.value.kind == "bad_encoding"


# ---------------------------------------------------------------------------------------------------
# Counting and the threshold


def test_counter_merges_and_threshold_message():
    first = BadSampleCounter(kept=90, bad={"corrupt_image": 6})
    second = BadSampleCounter(kept=10)
    second.add("empty_caption", 3)
    first += second
    first += {"corrupt_image": 1}
    first += RawBatch(torch.zeros(2, 3, 4, 4), ["a", "b"], {"tiny_image": 1})
    assert first.as_dict() == {
        "seen": 113,
        "kept": 102,
        "bad": {"corrupt_image": 7, "empty_caption": 3, "tiny_image": 1},
    }
    check_bad_fraction(first, threshold=0.1)  # 11 / 113 = 9.7 %: fine
    with pytest.raises(DataQualityError) as caught:
        check_bad_fraction(first, threshold=0.05)
    message = str(caught.value)
    assert "11 of 113" in message and "data.max_bad_fraction" in message
    assert "corrupt_image 7" in message and "empty_caption 3" in message and "tiny_image 1" in message
    check_bad_fraction(BadSampleCounter(kept=0, bad={"corrupt_image": 1}), 0.0, min_seen=10)  # too early
    with pytest.raises(ValueError, match="unknown bad-sample kind"):
        BadSample("misspelt_kind")


def test_bad_sample_survives_pickling_between_processes():
    import pickle

    restored = pickle.loads(pickle.dumps(BadSample("tiny_image", "1x1")))
    assert (restored.kind, restored.detail) == ("tiny_image", "1x1")


def test_assemble_batches_never_loses_counts():
    image = torch.zeros(3, 2, 2)
    outcomes = [BadSample("corrupt_image")] + [(image, str(i), f"k{i}") for i in range(5)] + [BadSample("tiny_image")] * 2
    batches = list(assemble_batches(iter(outcomes), batch_size=2, epoch=3, worker=1))
    assert [len(batch) for batch in batches] == [2, 2, 1]
    assert [batch.keys for batch in batches] == [["k0", "k1"], ["k2", "k3"], ["k4"]]
    # where each worker stands once a batch is consumed: the last one's cursor is the end of the stream
    assert [batch.positions for batch in batches] == [[(3, 1, 3, 1)], [(3, 1, 5, 2)], [(3, 1, 8, 3)]]
    total = BadSampleCounter()
    for batch in batches:
        total += batch
    assert total.as_dict() == {"seen": 8, "kept": 5, "bad": {"corrupt_image": 1, "tiny_image": 2}}
    dropped = list(assemble_batches(iter(outcomes), batch_size=2, drop_last=True))
    assert [len(batch) for batch in dropped] == [2, 2]
    assert sum(sum(batch.bad_samples.values()) for batch in dropped) == 3  # counts ride on the last batch
    only_bad = list(assemble_batches(iter([BadSample("corrupt_image")] * 3), batch_size=2))
    assert len(only_bad) == 1 and len(only_bad[0]) == 0 and only_bad[0].bad_samples == {"corrupt_image": 3}
    assert len(list(assemble_batches(iter(outcomes), batch_size=1, max_batches=3))) == 3


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


@pytest.mark.parametrize("separator", [b",", b"\t"])
def test_csv_dataset_skips_and_counts_every_bad_kind(tmp_path, separator):
    path, good, expected = write_caption_table(tmp_path, separator)
    dataset = CsvDataset(path, transform=TRANSFORM, batch_size=4, shuffle=False)
    captions, counter = collect(dataset)
    assert sorted(captions) == sorted(good)
    assert counter.bad == expected
    assert counter.kept == len(good) and dataset.num_rows == len(good) + sum(expected.values())


def test_csv_paths_outside_the_folder_are_kept_only_when_allowed(tmp_path):
    path, good, expected = write_caption_table(tmp_path)
    _, refused = collect(CsvDataset(path, transform=TRANSFORM, batch_size=4, shuffle=False))
    assert refused.bad["path_outside_root"] == 2
    with pytest.raises(DataQualityError, match="data.csv_allow_outside_paths=true"):  # the stop names the setting
        check_bad_fraction(refused, 0.01)
    dataset = CsvDataset(path, transform=TRANSFORM, batch_size=4, shuffle=False, allow_outside_paths=True)
    captions, counter = collect(dataset)
    assert sorted(captions) == sorted(good + ["outside relative", "outside absolute"])
    assert "path_outside_root" not in counter.bad


def test_csv_missing_column_error_names_columns_and_setting(tmp_path):
    path = tmp_path / "table.csv"
    path.write_text("path,caption\nx.jpg,hello\n")
    with pytest.raises(ValueError) as caught:
        CsvDataset(path, transform=TRANSFORM, batch_size=2)
    assert "'filepath'" in str(caught.value) and "data.csv_image_key" in str(caught.value)
    assert "['path', 'caption']" in str(caught.value)
    with pytest.raises(ValueError, match="data.csv_caption_key"):
        CsvDataset(path, transform=TRANSFORM, batch_size=2, image_key="path")
    tabbed = tmp_path / "tabbed.csv"
    tabbed.write_text("filepath\ttitle\nx.jpg\thello\n")
    with pytest.raises(ValueError, match="data.csv_separator"):
        read_caption_table(tabbed)
    assert read_caption_table(tabbed, separator="\t") == [("x.jpg", "hello")]


def test_csv_splits_over_ranks_and_workers_and_reshuffles_per_epoch(tmp_path):
    (tmp_path / "img.png").write_bytes(encode(noise(8, 8), "PNG"))
    path = tmp_path / "table.csv"
    path.write_text("filepath,title\n" + "".join(f"img.png,caption {i}\n" for i in range(23)))
    per_rank = []
    for rank in range(2):
        dataset = CsvDataset(path, transform=TRANSFORM, batch_size=5, rank=rank, world_size=2, seed=3)
        per_rank.append(collect(dataset)[0])
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == sorted(f"caption {i}" for i in range(23))
    assert {len(per_rank[0]), len(per_rank[1])} == {11, 12}
    dataset = CsvDataset(path, transform=TRANSFORM, batch_size=5, seed=3)
    epoch0 = collect(dataset)[0]
    assert collect(dataset)[0] == epoch0  # same epoch: same order
    dataset.set_epoch(1)
    epoch1 = collect(dataset)[0]
    assert epoch1 != epoch0 and sorted(epoch1) == sorted(epoch0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
    assert sorted(collect(loader)[0]) == sorted(epoch0)  # two workers: each row once


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


def test_write_shards_names_and_pattern(tmp_path):
    pattern, _, _, paths = write_broken_shards(tmp_path)
    assert [p.name for p in paths] == ["00000.tar", "00001.tar"]
    assert pattern == str(tmp_path / "{00000..00001}.tar")
    with tarfile.open(paths[0]) as tar:
        names = tar.getnames()
    assert names[:2] == ["000000.jpg", "000000.txt"] and "000007.txt" in names
    assert not list(tmp_path.glob("*.partial"))
    captions = read_captions(pattern, limit=100)  # bad captions skipped, the lonely caption included
    assert len(captions) == len(good_images()) + len(bad_images()) + 1
    assert read_captions(pattern, limit=3) == ["good rgb_jpeg", "good cmyk_jpeg", "good grey_png"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shard_dataset_skips_and_counts_every_bad_kind(tmp_path, num_workers):
    pattern, good, expected, _ = write_broken_shards(tmp_path)
    dataset = ShardDataset(pattern, transform=TRANSFORM, batch_size=3, shuffle_buffer=4, seed=1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=num_workers)
    captions, counter = collect(loader)
    assert sorted(captions) == sorted(good)
    assert counter.bad == expected


def test_shard_dataset_counts_an_unreadable_shard_and_keeps_going(tmp_path):
    paths = write_shards([(encode(noise(8, 8, i), "PNG"), f"c{i}") for i in range(6)], tmp_path, 3)
    (tmp_path / "00002.tar").write_bytes(b"this is not a tar file" * 50)
    dataset = ShardDataset(str(tmp_path / "{00000..00002}.tar"), transform=TRANSFORM, batch_size=4)
    captions, counter = collect(dataset)
    assert sorted(captions) == [f"c{i}" for i in range(6)] and counter.bad == {"corrupt_shard": 1}
    assert len(paths) == 2
    with pytest.raises(FileNotFoundError, match="brace pattern"):
        ShardDataset(str(tmp_path / "{00000..00009}.tar"), transform=TRANSFORM, batch_size=4)


def test_a_truncated_shard_counts_once(tmp_path):
    """A shard cut off inside a member is one corrupt shard; the samples before the cut are kept.

    Failed on main: corrupt_shard 2, webdataset calls the handler from the member read and again from the
    tar stream's next header.
    """
    samples = [(encode(noise(48, 48, i), "PNG"), f"c{i}") for i in range(9)]  # ~7 KB members
    paths = write_shards(samples, tmp_path, samples_per_shard=3)
    data = paths[1].read_bytes()
    paths[1].write_bytes(data[: len(data) // 2])  # inside sample 4's image
    dataset = ShardDataset(str(tmp_path / "{00000..00002}.tar"), transform=TRANSFORM, batch_size=2, shuffle_buffer=0)
    captions, counter = collect(dataset)
    assert counter.bad == {"corrupt_shard": 1}
    assert sorted(captions) == ["c0", "c1", "c2", "c3", "c6", "c7", "c8"]


def test_write_shards_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8) for _ in range(25)]
    samples = [(array, f"caption {i} \u00e9", {"index": i}) for i, array in enumerate(arrays)]
    paths = write_shards(samples, tmp_path / "out", samples_per_shard=10, image_format="png")
    assert len(paths) == 3
    with tarfile.open(paths[1]) as tar:
        member = tar.extractfile("000013.json").read()
    assert json.loads(member) == {"key": "000013", "index": 13}
    dataset = ShardDataset(shard_pattern(paths), transform=ToTensor(), batch_size=7, shuffle_buffer=0)
    dataset.shuffle_shards = False
    read = {}
    for batch in dataset:
        for image, caption in zip(batch.images, batch.captions):
            read[caption] = (image * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    assert sorted(read) == sorted(caption for _, caption, _ in samples)
    for array, caption, _ in samples:
        assert np.array_equal(read[caption], array)  # PNG: lossless


def test_weighted_resampled_sources_with_fixed_epoch(tmp_path):
    for source, shards in (("a", 4), ("b", 2)):
        for shard in range(shards):
            write_shards(
                [(encode(noise(8, 8, i), "PNG"), f"{source}{shard}-{i}") for i in range(5)],
                tmp_path / source / f"s{shard}",
                samples_per_shard=5,
            )
            (tmp_path / source / f"s{shard}" / "00000.tar").rename(tmp_path / source / f"{shard}.tar")
    spec = f"{tmp_path}/a/{{0..3}}.tar::{tmp_path}/b/{{0..1}}.tar"
    shards, weights = expand_shard_sources(spec, [1.0, 4.0])
    assert len(shards) == 6 and weights == [1.0] * 4 + [4.0] * 2
    # Source b: 2 shards x weight 4 = 8 against a: 4 x 1 = 4, so b is 2/3 of the drawn shards.
    dataset = ShardDataset(
        spec, weights=[1.0, 4.0], resampled=True, samples_per_epoch=50, transform=TRANSFORM, batch_size=8
    )
    stream = dataset._shard_stream(rank=0, world_size=1, worker=0, num_workers=1)
    drawn = [next(stream)["url"] for _ in range(6000)]
    assert abs(np.mean(["/b/" in url for url in drawn]) - 2 / 3) < 0.03
    # with_epoch: ceil(50 / (8 x 2 workers)) = 4 batches per worker, 64 samples in all, all full batches.
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
    captions, counter = collect(loader)
    assert len(captions) == 64 and counter.bad == {}
    assert {caption[0] for caption in captions} == {"a", "b"}
    dataset.samples_per_epoch = 40
    assert len(collect(dataset)[0]) == 40  # one worker: 5 batches of 8
    with pytest.raises(ValueError, match="data.resampled"):
        ShardDataset(spec, weights=[1.0, 4.0], transform=TRANSFORM, batch_size=8)
    with pytest.raises(ValueError, match="one weight per source"):
        expand_shard_sources(spec, [1.0])


def test_shards_split_over_ranks_without_overlap(tmp_path):
    paths = write_shards([(encode(noise(8, 8, i), "PNG"), f"c{i}") for i in range(20)], tmp_path, 5)
    seen = []
    for rank in range(2):
        dataset = ShardDataset(shard_pattern(paths), transform=TRANSFORM, batch_size=4, rank=rank, world_size=2)
        seen.append(collect(dataset)[0])
    assert len(seen[0]) == len(seen[1]) == 10 and not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == sorted(f"c{i}" for i in range(20))


def test_csv_to_shards_checks_images_and_counts(tmp_path):
    path, good, expected = write_caption_table(tmp_path / "source")
    paths, counter = csv_to_shards(path, tmp_path / "shards", samples_per_shard=4, image_size=SIZE)
    assert counter.bad == expected and counter.kept == len(good)
    captions, read_counter = collect(ShardDataset(shard_pattern(paths), transform=TRANSFORM, batch_size=5))
    assert sorted(captions) == sorted(good) and read_counter.bad == {}
    copied, _ = csv_to_shards(path, tmp_path / "copied", samples_per_shard=100)  # no resize: bytes copied
    with tarfile.open(copied[0]) as tar:
        names = tar.getnames()
        first_image = tar.extractfile(names[0]).read()
    assert first_image == good_images()[good[0].removeprefix("good ")][0]


# ---------------------------------------------------------------------------------------------------
# Evaluation sets


def test_load_class_folders(tmp_path):
    root = tmp_path / "classes"
    colours = {"cat": (255, 0, 0), "dog": (0, 255, 0), "sea_otter": (0, 0, 255)}
    for index, (folder, colour) in enumerate(colours.items()):
        (root / folder / "nested").mkdir(parents=True)
        for i in range(index + 1):
            (root / folder / "nested" / f"{i}.png").write_bytes(encode(Image.new("RGB", (9, 7), colour), "PNG"))
    (root / "dog" / "broken.jpg").write_bytes(b"not an image")
    (root / "dog" / "notes.txt").write_text("not an image file name either")
    with pytest.warns(UserWarning, match="corrupt_image 1"):
        dataset = load_class_folders(root)
    assert dataset.classnames == ["cat", "dog", "sea otter"]
    assert dataset.labels.tolist() == [0, 1, 1, 2, 2, 2]
    assert dataset.templates == ["a photo of a {}."]
    assert len(dataset.images) == 6 and dataset.images.skipped.bad == {"corrupt_image": 1}
    assert np.asarray(dataset.images[3])[0, 0].tolist() == [0, 0, 255]
    assert len(dataset.images[1:3]) == 2

    names_txt = tmp_path / "names.txt"
    names_txt.write_text("house cat\n\ndog\nsea otter\n")
    templates = tmp_path / "templates.txt"
    templates.write_text("a photo of a {}.\n\na drawing of the {}\n")
    with pytest.warns(UserWarning):
        dataset = load_class_folders(root, names_txt, templates, name="pets")
    assert dataset.name == "pets" and dataset.classnames[0] == "house cat"
    assert dataset.templates == ["a photo of a {}.", "a drawing of the {}"]
    names_json = tmp_path / "names.json"
    names_json.write_text(json.dumps({"cat": "kitty", "dog": "puppy", "sea_otter": "otter"}))
    assert load_class_folders(root, names_json, verify=False).classnames == ["kitty", "puppy", "otter"]

    names_txt.write_text("cat\ndog\n")
    with pytest.raises(ValueError, match="2 class names but there are 3 class folders"):
        load_class_folders(root, names_txt)
    names_json.write_text(json.dumps({"cat": "kitty"}))
    with pytest.raises(ValueError, match="dog"):
        load_class_folders(root, names_json)
    templates.write_text("no placeholder here\n")
    with pytest.raises(ValueError, match="line 1"):
        load_class_folders(root, templates_file=templates)


def test_load_karpathy_captions(tmp_path):
    (tmp_path / "images" / "val2014").mkdir(parents=True)
    for name, colour in (("a.jpg", (255, 0, 0)), ("b.jpg", (0, 255, 0)), ("c.jpg", (0, 0, 255))):
        Image.new("RGB", (12, 8), colour).save(tmp_path / "images" / "val2014" / name)
    entries = [
        {"filename": "a.jpg", "filepath": "val2014", "split": "test",
         "sentences": [{"raw": "A red  square."}, {"raw": "  "}, {"tokens": ["red", "thing"]}]},
        {"filename": "b.jpg", "filepath": "val2014", "split": "train", "sentences": [{"raw": "green"}]},
        {"filename": "missing.jpg", "filepath": "val2014", "split": "test", "sentences": [{"raw": "gone"}]},
        {"filename": "c.jpg", "filepath": "val2014", "split": "test", "sentences": [{"raw": "blue one"}]},
    ]
    path = tmp_path / "dataset_coco.json"
    path.write_text(json.dumps({"images": entries, "dataset": "coco"}))
    with pytest.warns(UserWarning, match="missing_file 1"):
        retrieval = load_karpathy_captions(path, tmp_path / "images")
    assert retrieval.captions == ["A red square.", "red thing", "blue one"]
    assert retrieval.caption_image.tolist() == [0, 0, 1]
    assert len(retrieval.images) == 2 and retrieval.images.skipped.bad == {"empty_caption": 1, "missing_file": 1}
    assert np.asarray(retrieval.images[1])[0, 0].tolist()[2] > 240  # c.jpg is blue
    paired = retrieval.paired(torch.arange(2), torch.arange(3))
    assert paired.tolist() == [[True, True, False], [False, False, True]]
    assert load_karpathy_captions(path, tmp_path / "images", split="train").captions == ["green"]
    with pytest.raises(ValueError, match="splits found: \\['test', 'train'\\]"):
        load_karpathy_captions(path, tmp_path / "images", split="val")


@pytest.mark.parametrize("verify", [True, False])
def test_karpathy_paths_outside_the_root_are_refused_and_counted(tmp_path, verify):
    """Failed on main: "../outside/secret.png", "../../../../etc/passwd" and absolute paths were opened and scored."""
    root = tmp_path / "images"
    root.mkdir()
    Image.new("RGB", (12, 8), (255, 0, 0)).save(root / "a.jpg")
    (tmp_path / "outside").mkdir()
    Image.new("RGB", (12, 8), (0, 0, 255)).save(tmp_path / "outside" / "secret.png")
    escaping = [{"filename": "../outside/secret.png"}, {"filename": "../../../../etc/passwd"},
                {"filename": str(tmp_path / "outside" / "secret.png")},
                {"filepath": str(tmp_path / "outside"), "filename": "secret.png"},
                {"filepath": "..", "filename": "outside/secret.png"}]
    entries = [{"filename": "a.jpg", "split": "test", "sentences": [{"raw": "red"}]}]
    entries += [{**entry, "split": "test", "sentences": [{"raw": f"secret {i}"}]} for i, entry in enumerate(escaping)]
    path = tmp_path / "captions.json"
    path.write_text(json.dumps({"images": entries}))
    with pytest.warns(UserWarning, match="path_outside_root 5"):
        retrieval = load_karpathy_captions(path, root, verify=verify)
    assert retrieval.captions == ["red"] and [p.name for p in retrieval.images.paths] == ["a.jpg"]
    assert retrieval.images.skipped.bad == {"path_outside_root": 5}


def test_every_documented_kind_is_exercised():
    exercised = {"corrupt_image", "tiny_image", "huge_image", "missing_file", "empty_caption", "bad_encoding",
                 "unpaired_member", "corrupt_shard", "path_outside_root",
                 "bad_label",  # in test_benchmarks.py (CLIP_benchmark's .cls labels)
                 "long_caption"}  # in test_hostile_inputs.py
    assert exercised == set(BAD_SAMPLE_KINDS)
