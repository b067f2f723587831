"""WebDataset tar shards: written, read back, every bad kind and an unreadable or truncated shard skipped
and counted, weighted and resampled sources, split over ranks."""
import hashlib
import json
import os
import tarfile

import numpy as np
import pytest
import torch
import webdataset as wds

from topoclip.data.shard_writer import csv_to_shards, shard_pattern, write_shards
from topoclip.data.shards import ShardDataset, command_urls, expand_shard_sources, expand_urls, read_captions
from topoclip.core.errors import UserError
from topoclip.preprocess.transforms import ToTensor

from _user_data import (SIZE, TRANSFORM, bad_images, collect, encode, good_images, noise, write_broken_shards,
                        write_caption_table)


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


def test_shard_pattern_expands_to_its_shards_past_99999(tmp_path):
    """The names grow a digit at shard 100,000; the pattern still expands (as webdataset expands it) to exactly the
    shards written, in order."""
    images = [noise(7, 7, seed) for seed in range(4)]
    paths = write_shards(((image, "a caption") for image in images), tmp_path, samples_per_shard=1,
                         image_format="png", first_shard=99_998)
    assert [p.name for p in paths] == ["99998.tar", "99999.tar", "100000.tar", "100001.tar"]
    for written in (paths, paths[1:3], paths[:1]):
        assert expand_urls(shard_pattern(written)) == [str(p) for p in written]
    every = [str(tmp_path / f"{shard:05d}.tar") for shard in range(100_002)]  # a whole conversion's names
    assert expand_urls(shard_pattern(every)) == every  # (one range would pad 00000..99999 to six digits)
    for wrong in ([paths[0], paths[2]], paths[::-1], [paths[0], tmp_path / "x" / "99999.tar"], [tmp_path / "a.tar"], []):
        with pytest.raises(ValueError, match="consecutive shards of one folder"):
            shard_pattern(wrong)


@pytest.mark.parametrize("relative", [False, True])
@pytest.mark.parametrize("folder", ["out{1..2}", "a,b{c}", "back\\slash", "${HOME}", "$HOME{", "}{", "run:2", "pipe:x",
                                    "shards-T10:00", "."])
def test_shard_pattern_names_a_folder_whose_name_holds_pattern_characters(tmp_path, folder, relative, monkeypatch):
    """Braces, a backslash, '${NAME}' or a leading 'word:' (a URL scheme to webdataset, 'pipe:' a command) in the folder
    are taken literally, by our expansion and by webdataset's own, whether the folder is given absolute or relative."""
    monkeypatch.setenv("WDS_HOME", "elsewhere")  # (unescaped, webdataset would read ${HOME} as $WDS_HOME)
    monkeypatch.chdir(tmp_path)
    paths = write_shards(((noise(7, 7, seed), "a caption") for seed in range(3)), folder if relative else tmp_path / folder,
                         samples_per_shard=1, image_format="png")
    for expand in (expand_urls, wds.shardlists.expand_urls):
        for written in (paths, paths[:1]):
            pattern = shard_pattern(written)
            assert [os.path.normpath(url) for url in expand(pattern)] == [os.path.normpath(p) for p in written]
            assert command_urls(pattern) == []  # local files: nothing webdataset would run or fetch
    with pytest.raises(ValueError, match="holds '::', which webdataset reads as a separator"):
        shard_pattern([tmp_path / "a::b" / "00000.tar"])


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


def test_csv_to_shards_shows_a_bar_while_it_hashes_the_csv_then_one_of_the_rows(tmp_path, capsys):
    """The CSV's sha256 (its identity for --resume) reads the whole file before the first row: a bar of its bytes."""
    path, good, expected = write_caption_table(tmp_path / "source")
    _, counter = csv_to_shards(path, tmp_path / "shards", samples_per_shard=4, progress=True)
    shown = capsys.readouterr().err
    assert f"hash {path.name}: 100%" in shown and "convert" in shown  # (every byte read)
    assert shown.index("hash") < shown.index("convert")
    recorded = json.loads((tmp_path / "shards" / "conversion.json").read_text())["csv_sha256"]
    assert recorded == hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(UserError, match="holds no conversion to resume"):  # refused before minutes of hashing
        csv_to_shards(path, tmp_path / "none", resume=True, progress=True)
    assert "hash" not in capsys.readouterr().err


def test_a_stopped_csv_conversion_resumes_into_the_shards_an_uninterrupted_one_writes(tmp_path, monkeypatch, capsys):
    """csv_to_shards(resume=True) continues after the last shard whose stats were written: a shard renamed before its
    stats and the scratch of one under way are written again, and every shard, stats file and count equals an
    uninterrupted conversion's; the stats cover every row, the bad ones after the last shard's too."""
    import topoclip.data.shard_writer as writer
    from topoclip.core.errors import UserError

    path, good, expected = write_caption_table(tmp_path / "source")  # (its last rows are bad)
    whole, whole_counter = csv_to_shards(path, tmp_path / "whole", samples_per_shard=3, image_size=SIZE)
    calls, decode = [0], writer.decode_image

    def stop_at_the_ninth(*args, **kwargs):  # the ninth image read: shards 0 and 1 are done, shard 2 is under way
        calls[0] += 1
        if calls[0] == 9:
            raise KeyboardInterrupt
        return decode(*args, **kwargs)
    monkeypatch.setattr(writer, "decode_image", stop_at_the_ninth)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        csv_to_shards(path, out, samples_per_shard=3, image_size=SIZE)
    monkeypatch.setattr(writer, "decode_image", decode)
    assert sorted(p.name for p in out.glob("*.tar")) == ["00000.tar", "00001.tar"]
    (out / "00001_stats.json").unlink()  # as if stopped between the shard's rename and its stats
    (out / ".00002.tar.0123456789ab.partial").write_bytes(b"a shard under way")
    with pytest.raises(UserError, match="--resume"):
        csv_to_shards(path, out, samples_per_shard=3, image_size=SIZE)
    with pytest.raises(UserError, match="samples_per_shard: 3 then, 4 now"):
        csv_to_shards(path, out, samples_per_shard=4, image_size=SIZE, resume=True)
    paths, counter = csv_to_shards(path, out, samples_per_shard=3, image_size=SIZE, resume=True)
    assert "resuming at shard 00001" in capsys.readouterr().err  # (00001's tar and 00002's scratch removed)
    assert [p.name for p in paths] == [p.name for p in whole] and len(whole) == -(-len(good) // 3)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (tmp_path / "whole").iterdir())
    for mine in out.iterdir():
        assert mine.read_bytes() == (tmp_path / "whole" / mine.name).read_bytes()
    assert (counter.kept, counter.bad) == (whole_counter.kept, whole_counter.bad) == (len(good), expected | counter.bad)
    stats = [json.loads(p.read_text()) for p in sorted(out.glob("*_stats.json"))]
    assert sum(s["count"] for s in stats) == stats[-1]["rows"][1] == counter.seen  # every row, in one chain
    assert json.loads((out / "conversion.json").read_text())["finished"]["rows"] == counter.seen
    assert csv_to_shards(path, out, samples_per_shard=3, image_size=SIZE, resume=True)[1].bad == counter.bad
    assert ": finished" in capsys.readouterr().err


def test_a_resume_refuses_what_is_not_its_conversion_in_one_line(tmp_path):
    from topoclip.core.errors import UserError

    path, good, _ = write_caption_table(tmp_path / "source")
    out = tmp_path / "out"
    csv_to_shards(path, out, samples_per_shard=3, image_size=SIZE)

    def refused(match):
        with pytest.raises(UserError, match=match):
            csv_to_shards(path, out, samples_per_shard=3, image_size=SIZE, resume=True)
    (out / "notes.txt").write_text("mine")
    refused("notes.txt\\): remove them")
    (out / "notes.txt").unlink()
    stats = (out / "00001_stats.json").read_text()
    for edited in ('{"rows": [3, "x"], "count": 3, "successes": 3, "skipped": {}}', '[1, 2]',
                   '{"rows": [3, 99], "count": 96, "successes": 3, "skipped": {}}'):
        (out / "00001_stats.json").write_text(edited)
        refused("00001_stats.json cannot be read .*remove it and every later shard")
    (out / "00001_stats.json").write_text(stats)
    (out / "00000.tar").unlink()  # a shard lost in the middle: the later ones are not thrown away
    refused("lacks shard 00000's tar or stats, though later ones exist")
    conversion = json.loads((out / "conversion.json").read_text())
    (out / "conversion.json").write_text("[1, 2]")
    refused("conversion.json cannot be read")
    (out / "conversion.json").write_text(json.dumps(conversion))
    path.write_bytes(path.read_bytes() + b"one more,images/rgb_jpeg.jpg,x\n")
    refused("csv_sha256: ")
    with pytest.raises(UserError, match="no conversion to resume .* without --resume"):
        csv_to_shards(path, tmp_path / "new", samples_per_shard=3, resume=True)
    assert not (tmp_path / "new").exists()


def test_a_resume_mends_what_a_stop_or_a_user_left_and_refuses_what_it_cannot_trust(tmp_path, monkeypatch, capsys):
    """A finished conversion whose last shard was removed writes it again; an all-bad CSV's totals survive a resume;
    a folder that holds only a stopped first write's scratch is a new one; a deeply nested, a misnamed or an empty
    file is refused in one line, as is a CSV moved without its images; a write that fails mid-shard leaves no scratch;
    an image path that is a FIFO is skipped, not read forever."""
    import errno
    import os
    import topoclip.data.shard_writer as writer
    from topoclip.core.errors import UserError

    path, good, expected = write_caption_table(tmp_path / "source")
    out = tmp_path / "out"
    paths, counter = csv_to_shards(path, out, samples_per_shard=3, image_size=SIZE)
    reference = {p.name: p.read_bytes() for p in out.iterdir()}
    for name in (paths[-1].name, f"{paths[-1].stem}_stats.json"):
        (out / name).unlink()
    assert csv_to_shards(path, out, samples_per_shard=3, image_size=SIZE, resume=True)[1].bad == counter.bad
    assert {p.name: p.read_bytes() for p in out.iterdir()} == reference

    def refused(match, folder=out, csv=path, **options):
        with pytest.raises(UserError, match=match):
            csv_to_shards(csv, folder, samples_per_shard=3, image_size=SIZE, resume=True, **options)
    (out / "00001_stats.json").write_text("[" * 100_000)
    refused("00001_stats.json cannot be read")
    (out / "00001_stats.json").write_bytes(reference["00001_stats.json"])
    (out / "000003.tar").write_bytes(b"")  # six digits with a leading zero: not a name the writer gives
    refused(r"does not write \(000003.tar\)")
    (out / "000003.tar").unlink()
    last = paths[-1]
    last.write_bytes(b"")
    refused(f"{last.name} cannot be read")
    last.write_bytes(reference[last.name])
    moved = tmp_path / "moved.csv"  # the CSV without its images
    moved.write_bytes(path.read_bytes())
    refused("images this conversion read are not where the CSV points now", csv=moved)

    bad_only = tmp_path / "bad.csv"  # no shard: refused, and the folder is new again (not one to resume)
    bad_only.write_text("filepath,title\nnot_there.jpg,a caption\n")
    with pytest.raises(UserError, match=r"no row of .* gave a sample \(kept 0 of 1; skipped missing_file 1\)"):
        csv_to_shards(bad_only, tmp_path / "bad", samples_per_shard=3)
    refused("no conversion to resume", folder=tmp_path / "bad", csv=bad_only)
    (tmp_path / "source" / "not_there.jpg").write_bytes(good_images()["rgb_jpeg"][0])
    (tmp_path / "source" / "bad.csv").write_bytes(bad_only.read_bytes())
    assert csv_to_shards(tmp_path / "source" / "bad.csv", tmp_path / "bad", samples_per_shard=3)[1].kept == 1

    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / ".conversion.json.0123456789ab.partial").write_text("{")
    csv_to_shards(path, stopped, samples_per_shard=3, image_size=SIZE)
    assert {p.name: p.read_bytes() for p in stopped.iterdir()} == reference

    def disk_full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(writer, "_add_member", disk_full)
    with pytest.raises(OSError):
        csv_to_shards(path, tmp_path / "full", samples_per_shard=3, image_size=SIZE)
    assert not [p.name for p in (tmp_path / "full").iterdir() if p.name.endswith(".partial")]
    monkeypatch.undo()

    fifo_table = tmp_path / "fifo" / "t.csv"
    fifo_table.parent.mkdir()
    os.mkfifo(fifo_table.parent / "x.png")
    fifo_table.write_text("filepath,title\nx.png,a caption\n")
    with pytest.raises(UserError, match="skipped missing_file 1"):  # (the only row: no shard)
        csv_to_shards(fifo_table, tmp_path / "fifo-out")
