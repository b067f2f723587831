"""What every command shares: registering a subcommand (with --debug), the --set option, one-line parse errors
and the types of numeric flags."""
from __future__ import annotations

import argparse
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


def add_command(commands, name: str, run, help: str) -> argparse.ArgumentParser:
    """Register subcommand `name`, run by `run(args) -> exit status`, with the options every command has."""
    command = commands.add_parser(name, help=help, description=help)
    # SUPPRESS: the subcommand's default must not overwrite a `topoclip --debug CMD` given before it.
    command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                         help="show the full traceback of any error")
    if run is not None:
        command.set_defaults(run=run)
    return command


