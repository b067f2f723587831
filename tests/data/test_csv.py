"""CSV/TSV caption tables: every bad kind skipped and counted, paths kept inside the folder, split over ranks
and workers."""
import pickle
import tracemalloc

import numpy as np
import pytest
import torch

from topoclip.data.csv import CaptionTable, CsvDataset, PackedRows, read_caption_table
from topoclip.data.quality import DataQualityError, check_bad_fraction

from _user_data import TRANSFORM, collect, encode, noise, write_caption_table


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


def test_packed_rows_give_back_every_row_as_read_and_travel_as_arrays(tmp_path):
    """CsvDataset keeps its rows packed (PackedRows): each row comes back as read_caption_table read it, a short
    row's None caption and an undecodable byte (a surrogate) included, in the process and after the pickle a
    fork-server worker gets; what travels is arrays, not one str per row."""
    path, *_ = write_caption_table(tmp_path)
    rows = read_caption_table(path) + [("", ""), ("b/ç.png", None), ("😀.jpg", "bad \udcff byte"), ("a.jpg", "x\udcc3\udca9")]
    for packed in (PackedRows(rows), pickle.loads(pickle.dumps(PackedRows(rows)))):
        assert len(packed) == len(rows) and [packed[i] for i in range(len(packed))] == rows
    packed = PackedRows(rows)
    assert all(isinstance(array, np.ndarray) for array in (*packed.images, *packed.captions, packed.no_caption))
    assert isinstance(CsvDataset(path, transform=TRANSFORM, batch_size=4).rows, PackedRows)
    with pytest.raises(IndexError):
        packed[-1]


def test_a_caption_table_is_checked_when_made_and_packed_as_it_is_read(tmp_path):
    """CaptionTable refuses a wrong header at once, reads its rows afresh on every pass, and CsvDataset packs them
    as they come: the most memory reading takes stays near the packed size, never the size of the rows as str."""
    with pytest.raises(FileNotFoundError, match="data.train_data"):
        CaptionTable(tmp_path / "absent.csv")
    path = tmp_path / "table.csv"
    path.write_text("filepath,title\n" + "".join(f"shard-{i // 100:03d}/{i:07d}.jpg,caption number {i} of many\n"
                                                 for i in range(20_000)))
    with pytest.raises(ValueError, match="data.csv_caption_key"):
        CaptionTable(path, caption_key="text")
    table = CaptionTable(path)
    assert list(table) == list(table) == read_caption_table(path) and len(read_caption_table(path)) == 20_000
    tracing = tracemalloc.is_tracing()  # (under python -X tracemalloc: measured from here, and left on)
    if not tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    packed = PackedRows(table)
    peak = tracemalloc.get_traced_memory()[1] - before
    if not tracing:
        tracemalloc.stop()
    assert [packed[i] for i in range(0, 20_000, 997)] == read_caption_table(path)[::997]
    size = sum(array.nbytes for array in (*packed.images, *packed.captions, packed.no_caption))  # ~65 bytes a row
    # The packed buffers grow with at most 1/8 spare (CPython's bytearray; array.array 1/16), beside one row's strings
    # and the file's read buffers (tens of KiB): under 1.25x the packed size on any build. Read as str tuples first,
    # the same rows peak over 4x.
    assert peak < 1.25 * size + 2**16
    with pytest.raises(ValueError):
        packed.images[0][0] = 0  # read-only: a worker that reads the rows never writes their pages
    path.write_text("image,caption\nx.jpg,other columns\n")
    with pytest.raises(ValueError, match="replaced after it was opened"):
        list(table)
    path.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        list(table)
