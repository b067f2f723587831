"""The `topoclip` command: it parses arguments and calls the library; nothing else lives here.

Each command is a pair of small functions: `add_NAME(commands)` registers its subparser (through
`add_command`, which gives every command `--debug`) and `command_NAME(args)` runs it and returns
the exit status. `COMMANDS` lists the registrations; a new command is one more pair and one entry.

Errors are handled once, in `main()`, for every command: a UserError (a setting, a file, the data,
the disk, the device; ConfigError is one) or an OSError (a missing or unwritable file) prints one
line `topoclip: error: ...` and exits with status 2; anything else is a bug and keeps its
traceback. `--debug` shows the traceback of every error. Ctrl-C exits with status 130, saying how to go on
where the command set `args.on_interrupt` (a line, or a function that returns one or None).
"""
from __future__ import annotations

import argparse
import errno
import os
import sys

from topoclip import __version__
from topoclip.cli.common import Parser
from topoclip.cli.analyze import add_analyze
from topoclip.cli.experiments import add_ablate, add_compare, add_report
from topoclip.cli.files import add_convert, add_data, add_export, add_push
from topoclip.cli.run import (add_benchmark, add_embed, add_eval, add_predict, add_presets, add_pretrained,
                             add_train)
from topoclip.core.errors import DISK_FULL_ERRNOS, UserError

USER_ERROR_STATUS = 2
INTERRUPTED_STATUS = 130


# --------------------------------------------------------------------------- the parser and main

# Each entry registers one command's subparser; the order is the order of `topoclip --help`.
COMMANDS = [add_train, add_eval, add_benchmark, add_embed, add_predict, add_convert, add_export, add_push, add_presets,
            add_pretrained,
            add_data, add_analyze, add_ablate, add_compare, add_report]


def parser() -> argparse.ArgumentParser:
    top = Parser(prog="topoclip", description="Train, evaluate and dissect CLIP models whose "
                                  "embedding topology (sphere, euclidean, product of spheres, hyperbolic) is a setting.")
    top.add_argument("--version", action="version", version=f"topoclip {__version__}")
    top.add_argument("--debug", action="store_true", help="show the full traceback of any error")
    commands = top.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(commands)
    return top


def describe_error(error: BaseException) -> str:
    """One line for a user error: its message, or for an OSError what failed on which file."""
    if isinstance(error, OSError) and not isinstance(error, UserError) and error.strerror:
        text = f"{error.strerror}: {error.filename}" if error.filename else error.strerror
        if error.errno in DISK_FULL_ERRNOS:
            text += "; free space and run the command again (train: with --resume RUN_FOLDER)"
        elif error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            text += "; choose a writable location (or make this one writable)"
    else:
        text = str(error) or type(error).__name__
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())  # one line, whatever it held


def main(argv=None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as stop:  # a mistyped command line, said in one line (Parser.error); --help exits as ever
        if stop.code in (0, None):
            raise
        return stop.code
    try:
        return args.run(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        hint = getattr(args, "on_interrupt", None)  # what a resumable command keeps, and how to go on
        hint = hint() if callable(hint) else hint
        print("topoclip: interrupted" + (f"; {hint}" if hint else ""), file=sys.stderr)
        return INTERRUPTED_STATUS
    except BrokenPipeError:  # the reader of our output went away (`topoclip presets | head`): nothing to say
        # Python's recipe: point stdout at devnull so the flush at exit does not fail a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (UserError, OSError) as error:
        if args.debug:
            raise
        print(f"topoclip: error: {describe_error(error)}", file=sys.stderr)
        return USER_ERROR_STATUS


if __name__ == "__main__":
    sys.exit(main())
