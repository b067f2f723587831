"""Hugging Face datasets in (data.source=hf, topoclip.data.hf): every form `datasets` writes (save_to_disk of a
Dataset and of a DatasetDict, Parquet, Arrow), the image column as an Image feature, bytes or paths, bad rows
skipped and counted, and what a stranger's folder could do refused in one line before anything trains. Resuming
is tested with the other streams (tests/training/test_resume_stream.py)."""
import io
import json
import os

import pytest
from PIL import Image

from topoclip.cli import main
from topoclip.config import ConfigError
from topoclip.data.hf import HfRows
from topoclip.run.training.logger import read_metrics

from _user_data import scene_samples

datasets = pytest.importorskip("datasets")

BATCH = 4
FAST = ["--preset", "tiny", "--quiet", "--batch-size", str(BATCH), "--workers", "0", "--set", "train.steps=3",
        "--set", "train.threads=1", "--set", "train.log_every=1", "--set", "evaluate.size=8",
        "--set", "train.warmup_steps=1"]
FEATURES = {"image": datasets.Image(), "text": datasets.Value("string")}


def rows(count=12):
    """(PNG bytes, caption) rows of built-in scenes, and one row whose image is not an image."""
    samples = scene_samples(count)
    return [{"image": {"bytes": png, "path": None}, "text": caption} for png, caption in samples] + [
        {"image": {"bytes": b"not an image", "path": None}, "text": "a broken row"}]


def table(data=None):
    return datasets.Dataset.from_list(data or rows(), features=datasets.Features(FEATURES))


def train_on(path, tmp_path, *extra):
    assert main(["train", "--train-data", str(path), *FAST, *extra, "--out", str(tmp_path / "run")]) == 0
    return [record["data"] for record in read_metrics(tmp_path / "run" / "metrics.jsonl") if "data" in record][-1]


@pytest.mark.parametrize("form", ["save_to_disk", "dataset_dict", "parquet", "parquet_folder", "arrow"])
def test_every_form_datasets_writes_trains_with_the_bad_row_counted(form, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))  # Parquet is converted there once
    data = table()
    if form == "save_to_disk":
        data.save_to_disk(str(tmp_path / "data"))
        path = tmp_path / "data"
    elif form == "dataset_dict":
        datasets.DatasetDict({"train": data, "test": table(rows(4))}).save_to_disk(str(tmp_path / "data"))
        path = tmp_path / "data"
    elif form == "parquet":
        data.to_parquet(str(tmp_path / "data.parquet"))
        path = tmp_path / "data.parquet"
    elif form == "parquet_folder":
        (tmp_path / "data").mkdir()
        data.select(range(6)).to_parquet(str(tmp_path / "data" / "0.parquet"))
        data.select(range(6, 13)).to_parquet(str(tmp_path / "data" / "1.parquet"))
        path = tmp_path / "data"
    else:
        data.save_to_disk(str(tmp_path / "saved"))
        path = next((tmp_path / "saved").glob("*.arrow"))
    counts = train_on(path, tmp_path)  # --train-data alone: the source is found from what the path holds
    assert json.loads((tmp_path / "run" / "config.json").read_text())["data"]["source"] == "hf"
    assert counts["bad"] == {"corrupt_image": 1} and counts["kept"] == 3 * BATCH


@pytest.mark.parametrize("form", ["save_to_disk", "parquet_file", "parquet_folder"])
def test_image_paths_resolve_inside_the_folder_and_a_path_outside_is_counted(form, tmp_path, monkeypatch):
    """Paths resolve inside the folder that holds the data, as a CSV's inside the CSV's folder: a file's folder, a
    folder of Parquet files itself, a save_to_disk folder's parent (the same images, however the data is named)."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "data"
    (folder / "images").mkdir(parents=True)
    data = []
    for index, (png, caption) in enumerate(scene_samples(8)):
        (folder / "images" / f"{index}.png").write_bytes(png)
        data.append({"image": f"images/{index}.png", "caption": [caption, "a second caption"]})
    data.append({"image": "/etc/passwd", "caption": ["outside"]})
    table = datasets.Dataset.from_list(data)
    if form == "save_to_disk":
        table.save_to_disk(str(folder / "table"))
        path = folder / "table"
    elif form == "parquet_file":
        path = folder / "table.parquet"
        table.to_parquet(str(path))
    else:
        path = folder
        table.to_parquet(str(folder / "0.parquet"))
    read = HfRows(path, "image", "caption")
    assert read[0] == ("images/0.png", data[0]["caption"][0]) and read.root == folder  # a list: its first caption
    counts = train_on(path, tmp_path, "--set", "data.hf_caption_column=caption")
    assert counts["bad"] == {"path_outside_root": 1} and counts["kept"] == 3 * BATCH


def test_an_image_struct_another_tool_wrote_and_a_relative_dataset_path_train(tmp_path, monkeypatch):
    """An Image column as pyarrow writes it (a struct of bytes and path, no datasets metadata), and the dataset given
    as "." from inside its folder: its images resolve where the same absolute path's do."""
    import pyarrow
    import pyarrow.parquet

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    samples = scene_samples(12)
    images = pyarrow.array([{"bytes": png, "path": None} for png, _ in samples],
                           type=pyarrow.struct([("bytes", pyarrow.binary()), ("path", pyarrow.string())]))
    (tmp_path / "data").mkdir()
    pyarrow.parquet.write_table(pyarrow.table({"image": images, "text": [caption for _, caption in samples]}),
                                str(tmp_path / "data" / "0.parquet"))
    assert isinstance(HfRows(tmp_path / "data")[0][0], bytes)
    monkeypatch.chdir(tmp_path / "data")
    assert HfRows(".").root == tmp_path / "data"
    assert train_on(".", tmp_path)["kept"] == 3 * BATCH


def test_dataset_type_auto_finds_a_dataset_as_no_flag_does(tmp_path, capsys):
    table().save_to_disk(str(tmp_path / "data"))
    assert main(["train", "--preset", "tiny", "--train-data", str(tmp_path / "data"), "--dataset-type", "auto",
                 "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["data"]["source"] == "hf"


@pytest.mark.parametrize("damage, message", [
    ("no_column", "has no column 'text' (setting data.hf_caption_column)"),
    ("split", "has no split 'validation' (setting data.hf_split)"),
    ("state_escape", "must be a plain file name"),
    ("link", "link"),
    ("not_arrow", "cannot be read as Parquet"),
    ("empty_folder", "no Parquet or Arrow file"),
    ("int_images", "column 'image' holds Value('int64')"),
    ("no_captions", "has no usable caption in its first"),
    ("blank_paths", "column 'image' has no image in its first"),
    ("empty_struct", "column 'image' has no image in its first"),
    ("int_struct", "column 'image' holds"),
    ("bytes_only_struct", "column 'image' holds"),
    ("absolute_paths", "set data.csv_allow_outside_paths=true"),
    ("empty_parquet", "has no rows"),
    ("empty_saved", "has no rows"),
    ("huge_info", "dataset info"),
])
def test_a_bad_dataset_is_one_line_before_any_folder(damage, message, tmp_path, capsys):
    path = tmp_path / "data"
    extra = []
    if damage == "no_column":
        datasets.Dataset.from_list([{"image": b"x", "caption": "y"}]).save_to_disk(str(path))
    elif damage == "split":
        datasets.DatasetDict({"train": table(rows(2))}).save_to_disk(str(path))
        extra = ["--set", "data.hf_split=validation"]
    elif damage == "state_escape":
        table(rows(2)).save_to_disk(str(path))
        state = json.loads((path / "state.json").read_text())
        state["_data_files"][0]["filename"] = "../../outside.arrow"
        (path / "state.json").write_text(json.dumps(state))
    elif damage == "link":
        table(rows(2)).save_to_disk(str(path))
        os.symlink("/etc/hostname", path / "extra.arrow")
    elif damage == "not_arrow":
        path = tmp_path / "data.parquet"
        path.write_bytes(b"PAR1 but not parquet")
    elif damage == "empty_folder":
        path.mkdir()
        (path / "notes.txt").write_text("nothing here")
        extra = ["--set", "data.source=hf"]
    elif damage == "int_images":
        datasets.Dataset.from_list([{"image": index, "text": "a caption"} for index in range(8)]).save_to_disk(str(path))
    elif damage == "no_captions":
        table([{**row, "text": None} for row in rows(8)]).save_to_disk(str(path))
    elif damage == "blank_paths":  # a column of image paths, each empty or blank
        datasets.Dataset.from_dict({"image": ["", " "] * 4, "text": ["a caption"] * 8}).save_to_disk(str(path))
    elif damage == "empty_struct":  # an Image column with neither bytes nor a path in any row
        import pyarrow
        import pyarrow.parquet

        images = pyarrow.array([{"bytes": None, "path": None}] * 8,
                               type=pyarrow.struct([("bytes", pyarrow.binary()), ("path", pyarrow.string())]))
        path.mkdir()
        path = path / "0.parquet"
        pyarrow.parquet.write_table(pyarrow.table({"image": images, "text": ["a caption"] * 8}), str(path))
    elif damage in ("int_struct", "bytes_only_struct"):  # structs that are not an Image column's (bytes, path)
        import pyarrow
        import pyarrow.parquet

        fields = ([("bytes", pyarrow.int64()), ("path", pyarrow.string())] if damage == "int_struct"
                  else [("bytes", pyarrow.binary())])
        values = [{"bytes": 1, "path": "a.png"} if damage == "int_struct" else {"bytes": b"x"}] * 8
        path.mkdir()
        path = path / "0.parquet"
        pyarrow.parquet.write_table(pyarrow.table({"image": pyarrow.array(values, type=pyarrow.struct(fields)),
                                                   "text": ["a caption"] * 8}), str(path))
    elif damage == "absolute_paths":
        (tmp_path / "elsewhere").mkdir()
        for index, (png, _) in enumerate(scene_samples(8)):
            (tmp_path / "elsewhere" / f"{index}.png").write_bytes(png)
        files = {"image": [str(tmp_path / "elsewhere" / f"{index}.png") for index in range(8)], "text": ["a"] * 8}
        path.mkdir()  # absolute paths to another folder (an Image feature's, when its files were not embedded)
        path = path / "data.parquet"
        datasets.Dataset.from_dict(files).to_parquet(str(path))
    elif damage == "empty_parquet":
        path = tmp_path / "data.parquet"
        table(rows(2)).select([]).to_parquet(str(path))
    elif damage == "empty_saved":
        table(rows(2)).select([]).save_to_disk(str(path))
    else:
        table(rows(2)).save_to_disk(str(path))
        info = json.loads((path / "dataset_info.json").read_text())
        (path / "dataset_info.json").write_text(json.dumps({**info, "description": "x" * (8 << 20)}))
    capsys.readouterr()  # datasets' own progress bars while the test wrote the folder
    code = main(["train", "--train-data", str(path), *FAST, *extra, "--out", str(tmp_path / "run")])
    error = capsys.readouterr().err
    assert code != 0 and error.count("\n") == 1 and message in error, error
    assert not (tmp_path / "run").exists()


def test_rows_give_bytes_for_an_embedded_image(tmp_path):
    table(rows(2)).save_to_disk(str(tmp_path / "data"))
    image, caption = HfRows(tmp_path / "data")[0]
    assert isinstance(image, bytes) and Image.open(io.BytesIO(image)).size[0] > 0 and caption
    with pytest.raises(ConfigError, match="has no column 'jpg'"):
        HfRows(tmp_path / "data", image_column="jpg")
