"""Bad samples: the typed error a loader skips, the counter that tallies them, and the threshold check.

A loader never stops on one bad sample in a million: it skips it and counts it by kind. The training loop
sums the counts from every worker and calls `check_bad_fraction`, which stops the run with a clear message
only when the bad fraction passes the setting `data.max_bad_fraction`.
"""
from __future__ import annotations

from typing import Mapping, Union

from topoclip.core.errors import UserError

# Every kind of bad sample a loader can skip, and what it means.
BAD_SAMPLE_KINDS = {
    "corrupt_image": "the image bytes could not be decoded (truncated, not an image, or an unsupported format)",
    "tiny_image": "an image side is shorter than DecodeSettings.min_size (default 2 pixels)",
    "huge_image": "the image has more pixels than the decompression-bomb guard DecodeSettings.max_pixels (default 100 M)",
    "missing_file": "the image file named by the row does not exist or cannot be read",
    "empty_caption": "the caption is missing, empty or only whitespace",
    "bad_encoding": "the caption bytes are not valid UTF-8",
    "long_caption": "the caption is longer than topoclip.data.images.MAX_CAPTION_CHARS (65,536) characters: not a caption",
    "unpaired_member": "a tar member has no image or no caption with the same key next to it",
    "bad_label": "an evaluation sample's class label (.cls) is not a whole number",
    "corrupt_shard": "a tar shard could not be opened or read to its end (counted once each time a shard fails)",
    "path_outside_root": "the image path is absolute or leads out of the data's folder (refused; for a CSV, "
                         "data.csv_allow_outside_paths=true allows it)",
}


class BadSample(Exception):
    """One sample that cannot be used: `kind` is a key of BAD_SAMPLE_KINDS, `detail` says what and where."""

    def __init__(self, kind: str, detail: str = ""):
        if kind not in BAD_SAMPLE_KINDS:
            raise ValueError(f"unknown bad-sample kind {kind!r}; known kinds: {sorted(BAD_SAMPLE_KINDS)}")
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind
        self.detail = detail

    def __reduce__(self):
        # Rebuild from (kind, detail) when sent between DataLoader worker processes.
        return BadSample, (self.kind, self.detail)


class DataQualityError(UserError, RuntimeError):
    """Too large a fraction of the samples read so far were bad."""


class BadSampleCounter:
    """Counts of kept samples and of skipped samples by kind; `seen = kept + bad`.

    Mergeable: `counter += other_counter`, `counter += {"corrupt_image": 2}` (bad counts only), or
    `counter += raw_batch` (kept += len(batch), bad += batch.bad_samples).
    """

    def __init__(self, kept: int = 0, bad: Mapping[str, int] | None = None):
        self.kept = int(kept)
        self.bad: dict[str, int] = {}
        for kind, count in (bad or {}).items():
            self.add(kind, count)

    @property
    def bad_total(self) -> int:
        return sum(self.bad.values())

    @property
    def seen(self) -> int:
        return self.kept + self.bad_total

    def add(self, kind: str, count: int = 1) -> None:
        """Count `count` skipped samples of `kind`."""
        if count:
            self.bad[kind] = self.bad.get(kind, 0) + int(count)

    def keep(self, count: int = 1) -> None:
        """Count `count` samples that were used."""
        self.kept += int(count)

    def __iadd__(self, other: Union["BadSampleCounter", Mapping[str, int], object]) -> "BadSampleCounter":
        if isinstance(other, BadSampleCounter):
            self.kept += other.kept
            bad = other.bad
        elif isinstance(other, Mapping):
            bad = other
        elif hasattr(other, "captions") and hasattr(other, "bad_samples"):  # a RawBatch
            self.kept += len(other.captions)
            bad = other.bad_samples
        else:
            return NotImplemented
        for kind, count in bad.items():
            self.add(kind, count)
        return self

    def __add__(self, other) -> "BadSampleCounter":
        total = BadSampleCounter(self.kept, self.bad)
        total += other
        return total

    def __eq__(self, other) -> bool:
        return isinstance(other, BadSampleCounter) and self.as_dict() == other.as_dict()

    def as_dict(self) -> dict:
        """{"seen": int, "kept": int, "bad": {kind: count}} with kinds sorted, for logs and JSON."""
        return {"seen": self.seen, "kept": self.kept, "bad": dict(sorted(self.bad.items()))}

    def describe(self) -> str:
        """One line: 'kept 980 of 1000; skipped corrupt_image 15, empty_caption 5'."""
        skipped = ", ".join(f"{kind} {count}" for kind, count in sorted(self.bad.items())) or "nothing"
        return f"kept {self.kept} of {self.seen}; skipped {skipped}"

    def __repr__(self) -> str:
        return f"BadSampleCounter({self.describe()})"


def check_bad_fraction(counter: BadSampleCounter, threshold: float, min_seen: int = 1) -> None:
    """Raise DataQualityError when bad / seen > threshold (checked once at least `min_seen` samples were seen)."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"data.max_bad_fraction must lie in [0, 1], got {threshold}")
    seen = counter.seen
    if seen < max(min_seen, 1):
        return
    fraction = counter.bad_total / seen
    if fraction > threshold:
        by_kind = ", ".join(f"{kind} {count}" for kind, count in sorted(counter.bad.items(), key=lambda kv: -kv[1]))
        hint = ""
        if counter.bad.get("path_outside_root"):
            hint = (" Image paths must lie inside the data's folder; for a CSV you trust, "
                    "data.csv_allow_outside_paths=true allows absolute and '..' paths.")
        raise DataQualityError(
            f"{counter.bad_total} of {seen} samples ({fraction:.1%}) were bad, more than "
            f"data.max_bad_fraction = {threshold:g}: {by_kind}. Fix or filter the data, or raise "
            f"data.max_bad_fraction if this many bad samples is expected.{hint}"
        )
