"""What every command shares: registering a subcommand (with --debug), the --set option, one-line parse errors
and the types of numeric flags."""
from __future__ import annotations

import argparse
import math
import sys


class Parser(argparse.ArgumentParser):
    """argparse with a mistyped command line said in one line, as every other user error is (exit status 2), and
    no abbreviations: `--out x` is never read as another flag that starts the same way."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        print(f"topoclip: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


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


def add_command(commands, name: str, run, help: str) -> argparse.ArgumentParser:
    """Register subcommand `name`, run by `run(args) -> exit status`, with the options every command has."""
    command = commands.add_parser(name, help=help, description=help)
    # SUPPRESS: the subcommand's default must not overwrite a `topoclip --debug CMD` given before it.
    command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                         help="show the full traceback of any error")
    if run is not None:
        command.set_defaults(run=run)
    return command


def add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set model.class_tokens=16 (repeatable; "
                        "values are JSON: numbers, true/false, [lists], or plain strings)")
