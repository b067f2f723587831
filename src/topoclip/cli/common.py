"""What every command shares: registering a subcommand (with --debug) and the --set option."""
from __future__ import annotations

import argparse


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
