"""CSV / TSV of image path + caption, read as a stream of RawBatches (OpenCLIP's `--csv-img-key` layout).

The table is read once (header row, then one row per sample); the samples are decoded lazily while
iterating. Image paths resolve against the table's folder (or `image_root`) and must stay inside it: an
absolute path or one leading out with ".." is skipped and counted as "path_outside_root" unless
`allow_outside_paths` (setting data.csv_allow_outside_paths) is set. Rows are split over
distributed ranks and then over DataLoader workers, and reshuffled every epoch from (seed, epoch).
A row whose image is missing or broken, or whose caption is empty or not UTF-8, is skipped and counted.
"""
from __future__ import annotations

import array
import csv
import io
import logging
import warnings
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import numpy as np
import torch
import torch.utils.data

from topoclip.data.batch import Outcome, RawBatch, assemble_batches, derived_seed, worker_position
from topoclip.data.images import DecodeSettings, clean_caption, decode_for, resolve_image_path
from topoclip.data.quality import BadSample
from topoclip.core.door import open_regular
from topoclip.core.errors import ConfigError

logger = logging.getLogger(__name__)


# What a table's problems are fixed with, named in its errors: training's settings; a command passes its flags.
SETTINGS = {"path": "setting data.train_data, OpenCLIP's --train-data",
            "image_key": "setting data.csv_image_key, OpenCLIP's --csv-img-key",
            "caption_key": "setting data.csv_caption_key, OpenCLIP's --csv-caption-key",
            "separator": "setting data.csv_separator, OpenCLIP's --csv-separator, whose default is a tab"}


def sniff_separator(path: Union[str, Path]) -> str:
    """Column separator from the file name: tab for .tsv / .tab, comma otherwise."""
    suffixes = [suffix.lower() for suffix in Path(path).suffixes]
    return "\t" if {".tsv", ".tab"} & set(suffixes) else ","


class CaptionTable:
    """The (image path as written, caption or None if the row is short) rows of a CSV / TSV with a header, read
    as they are iterated (the file is not held in memory); the header is checked when the table is made, and found
    the same on every pass.

    caption_key None: images only (every caption None).

    Text is read as UTF-8 with undecodable bytes kept as surrogates, so one bad caption is later skipped as
    "bad_encoding" instead of failing the whole file. Blank lines are ignored; a line csv cannot read is skipped
    and counted in a warning at the end of the pass, as is a row with a line over MAX_LINE_CHARS (`_Lines`). A quote
    that opens a field and never closes, or closes only past csv's field limit, refuses the table (csv would read the
    lines after it as one caption, or as rows cut anywhere); rows over several lines are read as csv reads them (a
    caption may hold a line break) and counted in a warning, since a stray quote that closes lines later looks the
    same.
    """

    def __init__(self, path: Union[str, Path], image_key: str = "filepath", caption_key: Optional[str] = "title",
                 separator: Optional[str] = None, names: Mapping[str, str] = SETTINGS):
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"caption table {self.path} does not exist ({names['path']})")
        self.separator = sniff_separator(self.path) if separator is None else separator
        with self._open() as file:
            unreadable = []
            lines = _Lines(file, unreadable, self.separator)
            header = self.header = self._header(csv.reader(lines, delimiter=self.separator), unreadable, lines)
        columns = {}
        for key, name in ((image_key, "image_key"), (caption_key, "caption_key")):
            if key is None:
                continue
            if key not in header:
                hint = ""
                if len(header) == 1:
                    other = "\t" if self.separator != "\t" else ","
                    if other in header[0]:
                        hint = f" The header contains {other!r}: make that the separator ({names['separator']})."
                raise ConfigError(f"{self.path} has no column {key!r} ({names[name]}); columns found: {header}.{hint}")
            columns[key] = header.index(key)
        self.image_column, self.caption_column = columns[image_key], columns.get(caption_key)

    def _open(self):
        """The table as text, through the door (a regular file: a FIFO is refused, not read; any size, streamed)."""
        return io.TextIOWrapper(open_regular(self.path, "caption table", limit=None, error=ConfigError), newline="",
                                encoding="utf-8-sig", errors="surrogateescape")  # -sig: a BOM is not text

    def _header(self, reader, unreadable: list, lines: "_Lines") -> list[str]:
        try:
            header = next(reader, None)
        except csv.Error as error:  # a header field past csv.field_size_limit()
            raise ConfigError(f"{self.path}: its header row cannot be read ({error}); is it a caption table?") from None
        if reader.line_num > 1 and header is not None:  # a quote opened in it and closed lines later, or never
            closes = "never closes" if lines.ended else f"closes on line {reader.line_num:,}"
            raise ConfigError(f"{self.path}: a quote opens in its header row and {closes}, so csv read the lines after "
                              f"it as header; the header names the image and caption columns on one line")
        if unreadable:  # (_Lines: the first line ran past MAX_LINE_CHARS)
            raise ConfigError(f"{self.path}: its first line is over {MAX_LINE_CHARS:,} characters, not a header row "
                              f"naming the image and caption columns")
        if header is None:
            raise ConfigError(f"{self.path} is empty; it needs a header row naming the image and caption columns")
        return [name.strip() for name in header]

    def __iter__(self) -> Iterator[tuple[str, Optional[str]]]:
        # The rows that cannot be read and the lines they held beyond one each; the rows over several lines, the longest
        unreadable, more_lines, several, longest = [], 0, 0, (0, 0)
        with self._open() as file:
            lines = _Lines(file, unreadable, self.separator)
            reader = csv.reader(lines, delimiter=self.separator)
            if self._header(reader, unreadable, lines) != self.header:  # the columns were found in another file
                raise ConfigError(f"{self.path} was replaced after it was opened (its header changed); read it again")
            while True:
                first, noted, lines.row_start = reader.line_num + 1, len(unreadable), True
                try:
                    row = next(reader)
                except StopIteration:
                    break
                except csv.Error as error:  # a field past csv.field_size_limit(): the reader goes on at the next line
                    # A quoted field over lines, or one left open on its line: going on would read the rest of it as rows.
                    if reader.line_num > first or quoted_after(lines.last, self.separator, False):
                        to = f" (to line {reader.line_num:,})" if reader.line_num > first else ""
                        raise ConfigError(f"{self.path}: the field that opens with a quote on line {first:,} runs past "
                                          f"what csv reads{to}, {error}: a quote that never closes, or closes too "
                                          f"late; close it, or write a quote inside a quoted field as \"\"") from None
                    unreadable.append(f"line {first:,}: {error}")
                    continue
                if lines.ended:  # csv asked for a line past the last in the middle of a row: a quote never closed
                    raise ConfigError(f"{self.path}: the quote that opens a field on line {first:,} never closes, so csv "
                                      f"read the {reader.line_num - first:,} line(s) after it as part of that field; "
                                      f"close it, or write a quote inside a quoted field as \"\"")
                if reader.line_num > first:
                    if len(unreadable) > noted:  # one of its lines was too long to read (_Lines): not whole
                        more_lines += reader.line_num - first
                        continue
                    several += 1
                    longest = max(longest, (first, reader.line_num), key=lambda span: span[1] - span[0])
                if not row or (len(row) == 1 and not row[0].strip()):
                    continue
                image = row[self.image_column] if self.image_column < len(row) else ""
                caption = row[self.caption_column] if self.caption_column is not None and self.caption_column < len(row) else None
                yield image, caption
        if unreadable:
            held = f" ({len(unreadable) + more_lines:,} lines)" if more_lines else ""
            _warn_once(f"{self.path}: skipped {len(unreadable):,} row(s) that cannot be read{held}, e.g. {unreadable[0]}")
        if several:  # read as csv reads them (a caption may hold a line break), but a stray quote looks the same
            _warn_once(f"{self.path}: {several:,} row(s) run over several lines ({_span(*longest)} the longest): a "
                       f"field that opens with a quote runs to the next quote, so one stray quote makes the rows after "
                       f"it part of one caption; if no caption holds a line break, fix the quote (a quote inside a "
                       f"quoted field is written \"\")")


# What this process has said about its tables: a table read twice (the tokenizer's captions, then the rows) says it
# once. (Python's own once-per-location registry is reset by every warnings.catch_warnings() another library enters.)
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        warnings.warn(message, stacklevel=3)
        _WARNED.add(message)  # after: a warning turned into an error (-W error) is raised again next time


def _span(first: int, last: int) -> str:
    return f"line {first:,}" if last <= first else f"lines {first:,}–{last:,}"


class _Lines:
    """The lines of a caption table for csv, none longer than MAX_LINE_CHARS, knowing the line it gave last (`last`)
    and whether it has run out (`ended`): csv asks for a line past the last only in the middle of a row, when a
    quoted field is still open.

    A longer line is read to its end in bounded pieces and left out, noted in `unreadable`; in its place a line that
    leaves csv as the whole line would: a blank line (skipped), or a lone quote where the line opens or closes a quoted
    field (the row then holds a line that was not read, and is skipped whole). `row_start` is set before each row:
    the lines csv asks for after the first of a row are inside a quoted field."""

    def __init__(self, file, unreadable: list, separator: str):
        self.file, self.unreadable, self.separator = file, unreadable, separator
        self.ended, self.last, self.number, self.row_start = False, "", 0, True

    def __iter__(self):
        return self

    def __next__(self) -> str:
        quoted, self.row_start = not self.row_start, False
        line = self.file.readline(MAX_LINE_CHARS + 1)
        if not line:
            self.ended = True
            raise StopIteration
        self.number += 1
        if len(line) > MAX_LINE_CHARS and not line.endswith(("\n", "\r")):  # (a lone \r ends a line too)
            after = quoted_after(line, self.separator, quoted)
            while (rest := self.file.readline(MAX_LINE_CHARS)):
                after = quoted_after(rest, self.separator, after)
                if rest.endswith(("\n", "\r")):
                    break
            self.unreadable.append(f"line {self.number:,}: over {MAX_LINE_CHARS:,} characters")
            line = '"\n' if after != quoted else "\n"
        self.last = line
        return line


# The longest line of a caption table read into memory: csv's own limit is per field (131,072 characters), after
# the whole line is read; a file of one endless line (or a sparse 4 GB file) would be read whole first.
MAX_LINE_CHARS = 1 << 20


def quoted_after(text: str, separator: str, quoted: bool) -> bool:
    """Whether csv (its default dialect, as CaptionTable reads: '"' quotes a field, "" is a quote inside one, a quote
    inside an unquoted field is text) is inside a quoted field after `text`, given whether it was before it."""
    state = "quoted" if quoted else "start"
    for char in text:
        if state == "start":  # at a field's first character
            state = "quoted" if char == '"' else "start" if char == separator else "field"
        elif state == "field":
            state = "start" if char == separator else "field"
        elif state == "quoted":
            state = "quote" if char == '"' else "quoted"
        else:  # a quote inside a quoted field: "" is one quote, anything else ends the quoting
            state = "quoted" if char == '"' else "start" if char == separator else "field"
    return state == "quoted"


def read_caption_table(path: Union[str, Path], image_key: str = "filepath", caption_key: Optional[str] = "title",
                       separator: Optional[str] = None) -> list[tuple[str, Optional[str]]]:
    """Every row of a CaptionTable, as a list."""
    return list(CaptionTable(path, image_key, caption_key, separator))


class PackedRows:
    """A caption table's (image, caption) rows held as UTF-8 bytes in arrays with offsets, not as Python strings.

    As str tuples the rows take twice the memory; a forked DataLoader worker that reads them writes their reference
    counts and so copies them all (PyTorch's issue #13246, memory that grows with the workers); and a worker started
    from a fork server (under torch.distributed) gets them pickled every epoch, far slower than arrays
    (docs/results/csv-rows.json). Every str comes back as read, the surrogates that stand for undecodable bytes
    included (see read_caption_table).
    """

    def __init__(self, rows: Iterable[tuple[str, Optional[str]]]):
        # Packed as they come, so a table read from a file (CaptionTable) is never held as strings, not even while
        # it is packed: the peak is the buffers' capacity, at most 1/8 over the packed size (docs/results/csv-rows.json).
        images, captions, no_caption = _Packer(), _Packer(), bytearray()
        for image, caption in rows:
            images.add(image)
            captions.add(caption or "")
            no_caption.append(caption is None)  # a short row's None
        self.images, self.captions = images.arrays(), captions.arrays()
        self.no_caption = _read_only(np.frombuffer(no_caption, dtype=bool))

    def __len__(self) -> int:
        return len(self.no_caption)

    def __getitem__(self, index: int) -> tuple[str, Optional[str]]:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        return _unpack(self.images, index), None if self.no_caption[index] else _unpack(self.captions, index)


class _Packer:
    """Strings appended as UTF-8 bytes to one buffer, with the offset where each ends."""

    def __init__(self):
        self.data, self.offsets = bytearray(), array.array("q", [0])

    def add(self, text: str) -> None:
        # surrogatepass, not surrogateescape: two escaped bytes that csv left side by side ("\udcc3\udca9", from
        # b"\xc3" and b"\xa9" around a quote) would come back as "é", a caption read as undecodable turned valid.
        self.data += text.encode("utf-8", "surrogatepass")
        self.offsets.append(len(self.data))

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Read-only views (no copy): (the bytes (total,) uint8, the offsets (n + 1,) int64: string i is
        bytes[offsets[i]:offsets[i + 1]])."""
        return _read_only(np.frombuffer(self.data, dtype=np.uint8)), _read_only(np.frombuffer(self.offsets, dtype=np.int64))


def _read_only(values: np.ndarray) -> np.ndarray:
    values.flags.writeable = False
    return values


def _unpack(packed: tuple[np.ndarray, np.ndarray], index: int) -> str:
    data, offsets = packed
    return data[offsets[index]:offsets[index + 1]].tobytes().decode("utf-8", "surrogatepass")


class CsvDataset(torch.utils.data.IterableDataset):
    """Image-caption pairs listed in a CSV / TSV; yields RawBatch (use DataLoader(batch_size=None)).

    Each epoch, rows are shuffled from (seed, epoch) (call `set_epoch` before iterating; with
    `persistent_workers=True` the workers keep the epoch they started with: wrap it in streams.SharedEpoch), then
    rank r of world_size takes rows r, r + world_size, ...; DataLoader worker w of W takes every W-th of those. Ranks
    therefore differ by at most one row, and by the bad rows each happens to meet.
    """

    def __init__(
        self,
        path: Union[str, Path],
        *,
        transform: Callable,
        batch_size: int,
        image_key: str = "filepath",
        caption_key: str = "title",
        separator: Optional[str] = None,
        image_root: Union[str, Path, None] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        decode: DecodeSettings = DecodeSettings(),
        allow_outside_paths: bool = False,
        crop_generator: Optional[torch.Generator] = None,
        rows: Optional[Sequence[tuple[Union[str, bytes], Optional[str]]]] = None,
    ):
        super().__init__()
        # The generator `transform` draws its random crop from, reseeded for every sample from (seed, epoch,
        # row), so a sample's crop does not depend on the worker layout or on a resume (None: the global RNG).
        self.crop_generator = crop_generator
        self.resume: dict[int, tuple[int, int]] = {}
        self.first = 0
        self.path = Path(path)
        self.allow_outside_paths = allow_outside_paths  # absolute / ".." image paths (else path_outside_root)
        # rows: another indexed table of (image path or bytes, caption) (topoclip.data.hf), instead of the CSV's
        self.rows = PackedRows(CaptionTable(self.path, image_key, caption_key, separator)) if rows is None else rows
        if not len(self.rows):
            raise ConfigError(f"{self.path} has a header but no rows" if rows is None else f"{self.path} has no rows")
        self.image_root = Path(image_root) if image_root is not None else self.path.parent
        self.transform = transform
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.decode = decode
        self.epoch = 0

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def set_epoch(self, epoch: int, resume: Optional[dict[int, tuple[int, int]]] = None, first: int = 0) -> None:
        """Select the shuffle order of `epoch` for the next iteration; `resume` maps a worker's share to the
        (cursor, made) of its last batch consumed (RawBatch.positions), where it continues; DataLoader
        worker w reads share (w + first) mod W, so the share due next comes first (see worker_position)."""
        self.epoch = int(epoch)
        self.resume, self.first = dict(resume or {}), int(first)

    def row_indices(self) -> np.ndarray:
        """Row indices (n,) this rank and worker read this epoch, in order."""
        rank, world_size, worker, num_workers = worker_position(self.rank, self.world_size, self.first)
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.rows))
        else:
            order = np.arange(len(self.rows))
        return order[rank::world_size][worker::num_workers]

    def load(self, index: int) -> Outcome:
        """(image tensor from the transform, caption) for one row, or the BadSample that rules it out."""
        written, raw_caption = self.rows[index]
        if self.crop_generator is not None:
            self.crop_generator.manual_seed(derived_seed(self.seed, self.epoch, index))
        try:
            caption = clean_caption(raw_caption)
            if isinstance(written, bytes):  # the image itself (a dataset's column), not a path to it
                image = written
            elif not written.strip():
                raise BadSample("missing_file", f"data row {index + 1} of {self.path} has no image path")
            else:
                image = resolve_image_path(written, self.image_root, self.allow_outside_paths)
            pixels = decode_for(self.transform, image, self.decode)
        except BadSample as bad:
            logger.debug("skipped data row %d of %s: %s", index + 1, self.path, bad)
            return bad
        return pixels, caption, f"row {index + 1}"

    def __iter__(self) -> Iterator[RawBatch]:
        worker = worker_position(self.rank, self.world_size, self.first)[2]
        cursor, made = self.resume.get(worker, (0, 0))
        outcomes = (self.load(int(index)) for index in self.row_indices()[cursor:])  # a resumed worker skips rows unread
        return assemble_batches(outcomes, self.batch_size, drop_last=self.drop_last, epoch=self.epoch, worker=worker,
                                start=(cursor, made))
