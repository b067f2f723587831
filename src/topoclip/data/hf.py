"""Hugging Face `datasets` in (data.source=hf, `pip install "topoclip[datasets]"`): a folder `save_to_disk` wrote
(a Dataset's, or a DatasetDict's with data.hf_split), or Parquet / Arrow files (one file, or a folder of them), read
as an indexed table of image + caption columns (data.hf_image_column, data.hf_caption_column).

The table is `datasets`' own, memory-mapped (Parquet converted into its cache once, as `load_dataset` does), so
a worker holds no copy of it. The image column may be an `Image` feature (its bytes, or a path), raw bytes, or a
path: bytes are decoded by topoclip's bounded decoder, and a path resolves inside the folder that holds the
data (a file's folder, a folder of Parquet / Arrow files itself, a save_to_disk folder's parent), as a CSV's image
paths resolve inside the CSV's folder (data.csv_allow_outside_paths lets them out). Columns of other types, and a
first batch of rows with no usable caption or only images outside that folder, are said before a run starts. A caption column of lists takes each row's first.
Rows are read as `CsvDataset` reads a table's: shuffled each epoch from (seed, epoch), split over ranks then
workers, resumed from each worker's (cursor, made), and a row whose image or caption cannot be used is skipped and
counted. Before `datasets` opens anything, the folder is checked through the door (no link, no special file) and
the files its state.json or dataset_dict.json name are plain names inside it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from topoclip.core.door import check_tree, is_folder, list_folder, read_json, regular_file
from topoclip.core.errors import ConfigError, check_file_name

FILES = (".parquet", ".arrow")
DATASET_STATE, DATASET_DICT, DATASET_INFO = "state.json", "dataset_dict.json", "dataset_info.json"
SETTINGS = {"path": "setting data.train_data", "image_key": "setting data.hf_image_column",
            "caption_key": "setting data.hf_caption_column", "split": "setting data.hf_split"}


def is_hf_data(path: Union[str, Path]) -> bool:
    """Whether `path` looks like data for this source: a save_to_disk folder, or a Parquet / Arrow file or folder."""
    path = Path(path)
    if path.suffix.lower() in FILES:
        return True
    return is_folder(path) and any(entry.name in (DATASET_STATE, DATASET_DICT) or entry.name.lower().endswith(FILES)
                                   for entry in list_folder(path, "dataset folder", error=ConfigError))


def _datasets():
    try:
        import datasets
    except ImportError:
        raise ConfigError("data.source=hf reads Hugging Face datasets: pip install 'topoclip[datasets]'") from None
    return datasets


def _check_state(folder: Path) -> None:
    """A save_to_disk folder's own files, before `datasets` reads them: its dataset_info.json bounded (datasets reads
    it whole), and the data files its state.json names plain names of files inside it (none: no rows)."""
    if (folder / DATASET_INFO).exists():  # (links and special files were refused with the folder: check_tree)
        read_json(folder / DATASET_INFO, "dataset info", folder, error=ConfigError)
    state = read_json(folder / DATASET_STATE, "dataset state", folder, error=ConfigError)
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list):
        raise ConfigError(f"{folder / DATASET_STATE} lists no data files; save the dataset again with save_to_disk")
    if not files:
        raise ConfigError(f"{folder} has no rows ({SETTINGS['path']})")
    for entry in files:
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(name, str):
            raise ConfigError(f"{folder / DATASET_STATE}: a data file without a file name")
        check_file_name(name, f"a data file of {folder / DATASET_STATE}", "save the dataset again with save_to_disk")
        regular_file(folder / name, "dataset file", folder, error=ConfigError)


def open_table(path: Union[str, Path], split: str = "train"):
    """(the `datasets.Dataset` at `path`, the folder its image paths resolve in: the folder that holds the data —
    a file's folder, a folder of Parquet / Arrow files itself, a save_to_disk folder's parent); see the module
    docstring. ConfigError naming the problem and the fix."""
    path = Path(path).absolute()  # its parent is a folder's, not the text's ("." has none)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist ({SETTINGS['path']}: a save_to_disk folder, or Parquet / "
                                f"Arrow files)")
    datasets = _datasets()
    if not is_folder(path):
        files, root = [regular_file(path, "dataset file", error=ConfigError)], path.parent
    else:
        check_tree(path, "dataset folder", error=ConfigError)
        names = {entry.name for entry in list_folder(path, "dataset folder", error=ConfigError)}
        root = path
        if DATASET_DICT in names:
            listed = read_json(path / DATASET_DICT, "dataset dict", path, error=ConfigError)
            splits = listed.get("splits") if isinstance(listed, dict) else None
            if not isinstance(splits, list) or not all(isinstance(name, str) for name in splits):
                raise ConfigError(f"{path / DATASET_DICT} lists no splits; save the dataset again with save_to_disk")
            if split not in splits:
                raise ConfigError(f"{path} has no split {split!r:.80} ({SETTINGS['split']}); its splits: {splits[:10]}")
            check_file_name(split, "the split", f"give one of {splits[:10]}")
            path = path / split
            names = {entry.name for entry in list_folder(path, "dataset folder", error=ConfigError)}
        if DATASET_STATE in names:
            _check_state(path)
            return _loaded(lambda: datasets.load_from_disk(str(path)), path), root.parent
        files = [path / name for name in sorted(names) if name.lower().endswith(FILES)]
        if not files:
            raise ConfigError(f"{path} holds no {DATASET_STATE} (a save_to_disk folder) and no Parquet or Arrow file")
    kinds = {file.suffix.lower() for file in files}
    if len(kinds) > 1:
        raise ConfigError(f"{path} mixes Parquet and Arrow files; give a folder of one kind")
    if kinds == {".arrow"}:
        return _loaded(lambda: datasets.concatenate_datasets([datasets.Dataset.from_file(str(file)) for file in files]),
                       path), root
    if not sum(_parquet_rows(file) for file in files):  # datasets would say "Instruction train corresponds to no data"
        raise ConfigError(f"{path} has no rows ({SETTINGS['path']})")
    return _loaded(lambda: datasets.Dataset.from_parquet([str(file) for file in files]), path), root


def _parquet_rows(file: Path) -> int:
    """The rows a Parquet file's footer says it holds; ConfigError when it has none readable."""
    import pyarrow.parquet

    try:
        return pyarrow.parquet.read_metadata(str(file)).num_rows
    except Exception as error:  # pyarrow's ArrowInvalid, OSError for what is not Parquet
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ConfigError(f"{file} cannot be read as Parquet ({first[:160]}); is it what to_parquet wrote?") from None


def _loaded(load, path: Path):
    datasets = _datasets()
    shown = datasets.is_progress_bar_enabled()  # (the singular names: datasets 2.14 has no plural ones)
    datasets.disable_progress_bar()  # its bars are for each worker and each check here: noise before a run's own
    try:
        table = load()
    except Exception as error:  # pyarrow and datasets raise many types for a file that is not what it says
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ConfigError(f"{path} cannot be read as a dataset ({first[:160]}); is it what save_to_disk or "
                          f"to_parquet wrote?") from None
    finally:
        if shown:
            datasets.enable_progress_bar()
    if not isinstance(table, datasets.Dataset):  # a DatasetDict's folder given below its dict
        raise ConfigError(f"{path} holds several splits; give the folder of one ({SETTINGS['split']})")
    return table


def _kind(feature, datasets) -> str:
    """"image", "bytes", "text", "texts" or "" (none of them) for a column's feature."""
    if isinstance(feature, datasets.Image) or (isinstance(feature, dict) and set(feature) == {"bytes", "path"}
                                                and _kind(feature["bytes"], datasets) == "bytes"
                                                and _kind(feature["path"], datasets) == "text"):
        return "image"  # (the struct of bytes and path an Image column is, written by another tool than datasets)
    if isinstance(feature, datasets.Value):
        return {"binary": "bytes", "large_binary": "bytes", "string": "text", "large_string": "text"}.get(feature.dtype, "")
    inner = getattr(feature, "feature", None)  # Sequence / List / LargeList of a feature
    return "texts" if inner is not None and _kind(inner, datasets) == "text" else ""


class HfRows:
    """The (image: bytes or a path as written, caption or None) rows of a `datasets` table's two columns; `root` is
    the folder an image path resolves in."""

    def __init__(self, path: Union[str, Path], image_column: str = "image", caption_column: str = "text",
                 split: str = "train"):
        table, self.root = open_table(path, split)
        datasets = _datasets()
        for column, setting, kinds, wanted in (
                (image_column, "image_key", ("image", "bytes", "text"), "an Image feature, bytes or image paths"),
                (caption_column, "caption_key", ("text", "texts"), "text, or lists of texts")):
            if column not in table.column_names:
                raise ConfigError(f"{path} has no column {column!r} ({SETTINGS[setting]}); columns found: "
                                  f"{table.column_names[:20]}")
            if _kind(table.features[column], datasets) not in kinds:
                raise ConfigError(f"{path}: column {column!r} holds {str(table.features[column])[:80]}, not {wanted} "
                                  f"({SETTINGS[setting]})")
        if isinstance(table.features[image_column], datasets.Image):  # its bytes and path, undecoded
            table = table.cast_column(image_column, datasets.Image(decode=False))
        self.table = table.select_columns([image_column, caption_column])
        self.image_column, self.caption_column = image_column, caption_column

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> tuple[Union[bytes, str], Optional[str]]:
        row = self.table[int(index)]
        image, caption = row[self.image_column], row[self.caption_column]
        if isinstance(image, dict):  # an Image feature: its bytes when embedded, else the file it names
            image = image.get("bytes") or image.get("path") or ""
        if isinstance(caption, (list, tuple)):
            caption = caption[0] if caption else None
        return (image if isinstance(image, (bytes, str)) else ""), (caption if isinstance(caption, str) else None)

    def captions(self, count: int) -> list[Optional[str]]:
        """The first `count` rows' captions, read from their column alone (no image is loaded)."""
        values = self.table.select_columns([self.caption_column])[:count][self.caption_column]
        return [value[0] if isinstance(value, (list, tuple)) and value else
                value if isinstance(value, str) else None for value in values]

    def has_images(self, count: int) -> bool:
        """Whether any of the first `count` rows has an image (bytes, or a path that is not blank), read without the
        bytes where the table allows."""
        import pyarrow.compute as compute
        import pyarrow.types

        if self.table._indices is not None:  # rows picked from a larger table: by row, as image_paths
            return any(image.strip() if isinstance(image, str) else image
                       for image, _ in (self[index] for index in range(min(len(self), count))))
        column = self.table.data.column(self.image_column).slice(0, count).combine_chunks()
        if pyarrow.types.is_struct(column.type):
            if bool(compute.any(compute.greater(compute.binary_length(column.field("bytes")), 0)).as_py()):
                return True
            column = column.field("path")
        if pyarrow.types.is_string(column.type) or pyarrow.types.is_large_string(column.type):
            return any(isinstance(value, str) and value.strip() for value in column.to_pylist())
        return bool(compute.any(compute.greater(compute.binary_length(column), 0)).as_py())

    def image_paths(self, count: int) -> list[str]:
        """The image paths among the first `count` rows (rows whose image is embedded have none), read without
        their bytes: an Image column's "path" field where its "bytes" are null, or a column of paths."""
        import pyarrow.compute
        import pyarrow.types

        if self.table._indices is not None:  # rows picked from a larger table (not what is read from disk): by row
            return [image for image, _ in (self[index] for index in range(min(len(self), count)))
                    if isinstance(image, str) and image.strip()]
        column = self.table.data.column(self.image_column).slice(0, count).combine_chunks()
        if pyarrow.types.is_struct(column.type):
            column = column.field("path").filter(pyarrow.compute.is_null(column.field("bytes")))
        elif not (pyarrow.types.is_string(column.type) or pyarrow.types.is_large_string(column.type)):
            return []
        return [value for value in column.to_pylist() if isinstance(value, str) and value.strip()]


def check_first_rows(rows: HfRows, count: int, allow_outside: bool, path) -> None:
    """ConfigError when none of the first `count` rows has a usable caption or any image, or every image of them is
    a path leading outside `rows.root` (what an Image feature cast from files stores: absolute paths)."""
    from topoclip.data.images import clean_caption, resolve_image_path
    from topoclip.data.quality import BadSample

    count = min(len(rows), count)

    def usable(read, value) -> bool:
        try:
            read(value)
            return True
        except BadSample:
            return False

    if not any(usable(clean_caption, caption) for caption in rows.captions(count)):
        raise ConfigError(f"{path}: column {rows.caption_column!r} has no usable caption in its first {count:,} "
                          f"rows ({SETTINGS['caption_key']})")
    if not rows.has_images(count):
        raise ConfigError(f"{path}: column {rows.image_column!r} has no image in its first {count:,} rows (each empty: "
                          f"no bytes, no path) ({SETTINGS['image_key']})")
    paths = rows.image_paths(count)
    if len(paths) == count and not allow_outside and not any(
            usable(lambda image: resolve_image_path(image, rows.root), image) for image in paths):
        raise ConfigError(f"{path}: the image paths of its first {count:,} rows lead outside {rows.root} (e.g. "
                          f"{paths[0][:80]!r}); embed the images in the dataset (an Image feature with bytes), or set "
                          f"data.csv_allow_outside_paths=true for a dataset you trust")
