"""The report's files: where they are (ROOT, RESULTS, README; read at call time, so a test may point RESULTS
elsewhere), a results file read through the door, a grid trained in parts pooled, an ablation landed, the
default run recorded."""
from __future__ import annotations

import contextlib
import gzip
import io
import json
import platform
import shlex
from collections import Counter
from pathlib import Path
from typing import Optional

from topoclip.core.door import (CONFIG_BYTES, is_folder, is_regular, list_folder, parse_json, read_bytes, read_json,
                                 read_text)
from topoclip.core.atomic import write_text_atomic
from topoclip.core.errors import file_name_problem


def _root() -> Path:
    """The checkout whose docs/results the report reads: the one this package is installed from (an editable install,
    a source tree), else the current folder."""
    here = Path(__file__).resolve().parents[4]
    return here if (here / "docs" / "results").is_dir() else Path.cwd()


ROOT = _root()


RESULTS = ROOT / "docs" / "results"


README = ROOT / "README.md"


def read_results(path: Path, root: Optional[Path] = None):
    """A results file's JSON, through topoclip's door (a regular file, inside `root` when given, bounded in size and
    depth; a packed NAME.json.gz unpacked, no larger than UNPACKED_BYTES); ValueError naming the file otherwise."""
    path = Path(path)
    if path.suffix != ".gz":
        return read_json(path, "results file", root, error=ValueError)
    data = read_bytes(path, "results file", root, error=ValueError)
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as unpacking:
            text = unpacking.read(UNPACKED_BYTES + 1)
    except (OSError, EOFError) as error:
        raise ValueError(f"results file {path} is not gzip ({error})") from None
    if len(text) > UNPACKED_BYTES:
        raise ValueError(f"results file {path} unpacks past {UNPACKED_BYTES:,} bytes")
    return parse_json(text, f"results file {path}", error=ValueError)


# A packed results file unpacks to at most this (the largest ablation.json is ~0.9 MB).
UNPACKED_BYTES = CONFIG_BYTES


def results_file(folder: Path, name: str) -> Path:
    """FOLDER/NAME (a .json), or its packed FOLDER/NAME.gz where only that is there (`pack`)."""
    packed = folder / f"{name}.gz"
    return packed if not (folder / name).exists() and packed.exists() else folder / name


def listed(folder: Path, suffixes: tuple[str, ...] = (), folders: bool = False) -> list[Path]:
    """The files of `folder` whose names end with one of `suffixes` (its folders with `folders`), sorted by name,
    listed through the door: links are neither followed nor listed. [] where there is no such folder."""
    if not is_folder(folder):
        return []
    return [folder / entry.name for entry in list_folder(folder, "results folder", error=ValueError)
            if (entry.is_dir(follow_symlinks=False) if folders else
                entry.is_file(follow_symlinks=False) and entry.name.endswith(suffixes))]


def analysis_files(folder: Path) -> list[Path]:
    """The per-run JSON files of an analysis folder (NAME/*.json or, packed, *.json.gz), sorted by their stem."""
    return sorted(listed(folder, (".json", ".json.gz")), key=lambda path: path.name.removesuffix(".gz"))


def pack(folder: Path) -> list[Path]:
    """Replace every ablation.json and per-run analysis JSON below docs/results/FOLDER... by its gzip (.json.gz, the
    bytes the same on every machine: no file name or time in the header); what the readers read is unchanged. The
    specs and pools at the top of docs/results stay plain. Returns the files written."""
    written = []
    for path in [path for part in listed(Path(folder), folders=True) for path in listed(part, (".json",))]:
        target = path.with_name(path.name + ".gz")
        target.write_bytes(gzip.compress(read_bytes(path, "results file", limit=UNPACKED_BYTES, error=ValueError),
                                         compresslevel=9, mtime=0))
        path.unlink()
        written.append(target)
    return written


def check_pool(name: str, spec) -> dict:
    """`spec`, a grid in parts' file (docs/results/NAME.json), checked for its shape: "parts" a list of folder names
    of docs/results, "seeds" a whole number ≥ 1 or absent; ValueError naming what is wrong otherwise."""
    parts, seeds = spec.get("parts"), spec.get("seeds")
    if not isinstance(parts, list) or not all(isinstance(part, str) and not file_name_problem(part) for part in parts):
        raise ValueError(f"docs/results/{name}.json: \"parts\" must be a list of folder names of docs/results, not "
                         f"{json.dumps(parts)[:80]}")
    if seeds is not None and (type(seeds) is not int or seeds < 1):
        raise ValueError(f"docs/results/{name}.json: \"seeds\" must be a whole number ≥ 1, not {json.dumps(seeds)[:40]}")
    return spec


def pools() -> dict[str, dict]:
    """Every grid trained in parts in docs/results (`pooled`): its name → its file's contents, checked (`check_pool`)."""
    found = {}
    for file in listed(RESULTS, (".json",)):
        results = read_results(file)
        if isinstance(results, dict) and "parts" in results:
            found[file.stem] = check_pool(file.stem, results)
    return found


def pooled(name: str, spec: dict) -> dict:
    """A grid trained in parts (docs/results/NAME.json: {"about", "parts": [folder, ...], "seeds"?}): `topoclip ablate`
    runs of one grid with the same settings, each into its own folder (`--cells`, `--first-seed K --seeds N`), where one
    sitting of the machine cannot train it whole (its file may be written before the first part lands: no runs yet).
    Their runs as one ablation ("runs", "steps", "grid", "parts": what a comparison, a convergence rule and τ's late
    rise read; not a grid's own table), and "unfinished": each cell with fewer than its "seeds" (seeds 0 to seeds − 1,
    the runs it was registered with) so far, which `cell_values` refuses.
    Refused: a part that is not a landed ablation folder, or listed twice; parts of other schedules, presets or
    settings (`run_settings`); a run (cell and seed) in two parts, or a seed beyond the registered ones."""
    parts, seeds = check_pool(name, spec)["parts"], spec.get("seeds")
    if len(set(parts)) < len(parts):
        raise ValueError(f"{name}.json must list its parts, each once: {parts}")
    if not parts:  # registered before its first part landed: no runs yet
        return {"analysis": "ablation", "grid": None, "steps": None, "parts": [], "seeds": seeds, "runs": [],
                "stopped": [], "unfinished": {}}
    grids = {}
    for part in parts:
        path = results_file(RESULTS / part, "ablation.json")
        grids[part] = read_results(path) if path.exists() else {}
        runs = grids[part].get("runs") if isinstance(grids[part], dict) else None
        stopped = grids[part].get("stopped", []) if isinstance(grids[part], dict) else None
        if not isinstance(grids[part], dict) or grids[part].get("analysis") != "ablation" or not all(
                isinstance(listed, list) and all(isinstance(run, dict) and isinstance(run.get("cell"), str)
                                                 and type(run.get("seed")) is int for run in listed)
                for listed in (runs, stopped)):
            raise ValueError(f"{name}: part {part} is not an ablation folder of docs/results; land it first "
                             f"(topoclip report land OUT --pool {name})")
    for what, read in (("steps", lambda g: g.get("steps")), ("preset", lambda g: g.get("preset")),
                       ("settings", lambda g: run_settings(g.get("command", "")))):
        first = read(grids[parts[0]])
        other = next((part for part in parts if read(grids[part]) != first), None)
        if other:
            theirs = read(grids[other])
            if what == "settings":  # only the options that differ
                keys = sorted(key for key in theirs.keys() | first.keys() if theirs.get(key) != first.get(key))
                theirs, first = ({key: options.get(key) for key in keys} for options in (theirs, first))
            raise ValueError(f"{name}: part {other} differs from {parts[0]} in {what} ({theirs} against {first}): "
                             f"one grid, one recipe")
    runs = [{**run, "part": part} for part, grid in grids.items() for run in grid["runs"]]
    # a run that stopped on non-finite values is done too (not trained again), but in no table
    stopped = [{**run, "part": part} for part, grid in grids.items() for run in grid.get("stopped", [])]
    twice = [key for key, count in Counter((run["cell"], run["seed"]) for run in runs + stopped).items() if count > 1]
    if twice:
        raise ValueError(f"{name}: {twice[0][0]} seed {twice[0][1]} is in two of its parts; a run would count twice")
    beyond = next((run for run in runs + stopped if seeds and not 0 <= run["seed"] < seeds), None)
    if beyond:
        raise ValueError(f"{name}: {beyond['part']}'s {beyond['cell']} seed {beyond['seed']} is not one of the "
                         f"{seeds} seeds registered")
    counts = Counter(run["cell"] for run in runs + stopped)
    return {"analysis": "ablation", "grid": grids[parts[0]].get("grid"), "steps": grids[parts[0]].get("steps"),
            "parts": parts, "seeds": seeds, "runs": runs, "stopped": stopped,
            "unfinished": {cell: n for cell, n in counts.items() if seeds and n < seeds}}


# `topoclip ablate`'s options that choose which runs of a grid it trains and where, not how they train
PART_OPTIONS = ("cells", "first_seed", "seeds", "jobs", "out", "reuse", "debug")


def run_settings(command: str) -> dict:
    """How the runs of an `ablate` command line train: its options as `topoclip ablate` parses them (defaults, `--opt=v`
    and the order of --set as it reads them), less those that only choose which runs and where (PART_OPTIONS)."""
    import argparse

    from topoclip.experiments.runner import add_ablate_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--debug", action="store_true")
    add_ablate_arguments(parser)
    if not isinstance(command, str):  # shlex.split(None) would read the command from standard input
        raise ValueError(f"{command!r} is not a `topoclip ablate` command line")
    words = shlex.split(command)
    try:
        if words[:2] != ["topoclip", "ablate"]:
            raise SystemExit(2)
        with contextlib.redirect_stderr(io.StringIO()):
            args = vars(parser.parse_args(words[2:]))
    except SystemExit:
        raise ValueError(f"{command!r} is not a `topoclip ablate` command line") from None
    return {key: value for key, value in args.items() if key not in PART_OPTIONS and not callable(value)}


def load_result(name: str):
    """docs/results/NAME.json (a grid trained in parts: `pooled`), NAME/ablation.json, or the list of NAME/*.json (one
    analysis per run, each with its file's stem added as "file"). (The blocks computed from several files, such as
    the headline, are topoclip.experiments.results.documents.load_block's.)"""
    if (RESULTS / f"{name}.json").exists():
        results = read_results(RESULTS / f"{name}.json")
        return pooled(name, results) if isinstance(results, dict) and "parts" in results else results
    if results_file(RESULTS / name, "ablation.json").exists():
        return read_results(results_file(RESULTS / name, "ablation.json"))
    runs = analysis_files(RESULTS / name)
    if not runs:
        raise FileNotFoundError(f"no results for block {name!r} in {RESULTS}")
    return [{**read_results(path), "file": path.name.removesuffix(".gz").removesuffix(".json")} for path in runs]


def record(run_dir: Path, wall_seconds: float, command: str) -> Path:
    """docs/results/default-run.json from a finished run folder."""
    import torch

    from topoclip.io.run_folder import read_metrics

    last = [m for m in read_metrics(run_dir / "metrics.jsonl") if "t" in m][-1]
    results = {"command": command, "wall_seconds": wall_seconds, "torch": torch.__version__.split("+")[0],
               "machine": f"{platform.machine()}, {torch.get_num_threads()} threads (the 2-core development machine)",
               "temperature": f"τ = {last['scale']:.2f} (t = {last['t']:.3f})",
               "records": read_json(run_dir / "eval.json", "eval.json", error=ValueError)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "default-run.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path


def write_pool(name: str, spec: dict) -> None:
    """docs/results/NAME.json, a grid in parts' file, replaced in one step: a reader never meets half of it."""
    write_text_atomic(RESULTS / f"{name}.json", json.dumps(spec, indent=1, ensure_ascii=False) + "\n")


def land(out_dir: Path, pool: Optional[str] = None, replace: bool = False) -> Path:
    """docs/results/NAME/ablation.json from `topoclip ablate --out OUT` (NAME: OUT's name): its ablation.json alone
    (table.md repeats it; the plots are drawn on demand, `plot`), without indentation; `ablate` records its command
    with X/ for each absolute path, so the file names no machine path. pool: the grid in parts (docs/results/POOL.json,
    `pooled`) that NAME is a part of, which gets it. Lands all of it or nothing: refused (and what was there before
    kept) where the pool does not take it, or where NAME is a part of another pool; docs/results/NAME holding other
    results is replaced only with `replace`."""
    results = read_results(out_dir / "ablation.json", out_dir)
    name = out_dir.resolve().name
    if not isinstance(results, dict) or results.get("analysis") != "ablation":
        raise ValueError(f"{out_dir}/ablation.json is not what `topoclip ablate` writes")
    if (RESULTS / f"{name}.json").is_file():  # load_result would read it, not the folder
        raise ValueError(f"docs/results/{name}.json exists and would hide docs/results/{name}/: rename {out_dir}")
    found = pools()
    other = next((other for other, spec in found.items() if name in spec["parts"] and other != pool), None)
    if other:
        raise ValueError(f"{name} is a part of {other}: land it with --pool {other}")
    if pool and pool not in found:
        raise ValueError(f"docs/results/{pool}.json is not a grid in parts ({{\"about\", \"parts\": [...]}}): write it first")
    path, packed = RESULTS / name / "ablation.json", results_file(RESULTS / name, "ablation.json")
    made = not path.parent.is_dir()
    before = read_text(path, "results file", limit=UNPACKED_BYTES, error=ValueError) if is_regular(path) else None
    written = json.dumps(results, ensure_ascii=False, separators=(",", ":"))
    if packed != path and read_results(packed) == json.loads(written):
        # landed before and packed since: the same results; listed again where the pool's file lost the part (a
        # landing undone)
        if pool and name not in found[pool]["parts"]:
            spec = {**found[pool], "parts": found[pool]["parts"] + [name]}
            pooled(pool, spec)
            write_pool(pool, spec)
        return packed
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(written, encoding="utf-8")
    try:
        if pool:
            spec = found[pool]
            spec["parts"] += [name] * (name not in spec["parts"])
            pooled(pool, spec)
        if (before is not None and before != written or packed != path) and not replace:
            raise ValueError(f"docs/results/{name}/ablation.json holds other results; land under another name (rename "
                             f"{out_dir}), or pass --replace to replace them")
        if packed != path:  # replaced: the plain file is the landing
            packed.unlink()
        if pool:
            write_pool(pool, spec)
    except Exception:
        if before is not None:
            path.write_text(before, encoding="utf-8")
        else:
            path.unlink()
            if made:
                path.parent.rmdir()
        raise
    return path
