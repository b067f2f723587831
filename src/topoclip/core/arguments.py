"""Types and options of the command line that a lower layer reads too: whole and bounded numbers, and `--set` (the
experiments parse the `topoclip ablate` command lines their results record with the options `ablate` has)."""
from __future__ import annotations

import argparse
import math


def whole(low: int = 1):
    """An argparse type: a whole number ≥ `low` (a size, a count; 0 where `low` is 0)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"must be a whole number ≥ {low}, not {text!r:.40}")
        return value
    return parse


def number(low: float = -math.inf, high: float = math.inf, low_inclusive: bool = True):
    """An argparse type: a finite number in [low, high] (or (low, high] with low_inclusive=False)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (value >= low if low_inclusive else value > low) and value <= high):
            bounds = f"{'[' if low_inclusive else '('}{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"must be a finite number in {bounds}, not {text!r:.40}")
        return value
    return parse


def add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set model.class_tokens=16 (repeatable; "
                        "values are JSON: numbers, true/false, [lists], or plain strings)")
