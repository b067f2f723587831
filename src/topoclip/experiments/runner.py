"""`topoclip ablate`: train every run of a grid that is not finished, J at a time, probe it, report the grid.

Runs live in ``OUT/runs/CELL/seed-K/`` (the trainer's run folders). **Resumable**: a run that trained
all its steps and wrote eval.json is finished and is not trained again; a run folder with a
config.json but not finished (killed) is resumed from its newest checkpoint; anything else starts afresh. A folder
made with other settings is refused (use another OUT). ``--jobs J`` trains J runs at once in
separate processes (each with cores / J threads). After training, each run gets a linear probe
(``probe.json`` beside eval.json, also resumable). Then the report (`topoclip.experiments.report`):
``OUT/table.md`` (mean ± std over seeds, the columns of Table 6), ``OUT/ablation.json`` (every run
and every row, the command, when it started, the machine, the code, the wall time), ``OUT/curves.png`` (the
validation curves) and ``OUT/temperature.png`` (every run's τ, one colour per cell).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from topoclip.analysis.output import write_json
from topoclip.analysis.temperature import read_curve
from topoclip.config import ConfigError, load_config
from topoclip.model.clip import describe_model
from topoclip.core.door import check_inside, copy_tree, is_folder, is_regular, list_folder, read_json, remove_tree
from topoclip.experiments.grid import (RUNS, Grid, RunSpec, config_differences, load_grid, out_folder, plan,
                                       saved_settings)
from topoclip.experiments.report import PROBE_TASK, stopped_reason, write_report
from topoclip.core.errors import NonFiniteError
from topoclip.core.losses import get_loss
from topoclip.core.locks import claim_folder
from topoclip.io.run_folder import EVALUATION, RunFolder

PROBE = "probe.json"
REUSED = "reused.json"  # in a run folder copied from another ablation: where from
STOPPED = "stopped.json"  # in a run folder that stopped on non-finite values: why (not trained again, not tabulated)


def reuse_runs(specs: Sequence[RunSpec], sources: Sequence, log: Callable[[str], None] = print) -> int:
    """Copy in every run of `specs` not started yet that another ablation folder has finished with the same config.

    sources: ablation output folders (their OUT/runs/*/seed-*/), anyone's: read and copied through the door (a link
    or a special file in a run refuses that copy, whole). A finished run (eval.json) whose config.json equals the
    spec's config, the run's name aside, is copied whole, except its probe (re-run at this grid's --probe-size), and
    gets RUN/reused.json naming its source. A run whose config cannot be read is left out, with a note. Returns the
    number of runs copied.
    """
    finished = [run for source in sources for run in finished_runs(Path(source))]
    if sources and not finished:
        raise ConfigError(f"--reuse {' '.join(map(str, sources))}: no finished run there (expected OUT/{RUNS}/CELL/seed-K/{EVALUATION})")
    configs = {}
    for source, run in finished:
        try:
            configs[run] = saved_settings(RunFolder(run).config, source)
        except ConfigError as error:
            log(f"--reuse: left out {run}: {error}")
    copied = 0
    for spec in specs:
        source = next((run for run, config in configs.items() if not config_differences(config, spec.config)), None)
        if source is None or run_state(spec) != "new" or Path(spec.run_dir).resolve() == source.resolve():
            continue
        remove_tree(spec.run_dir, out_folder(spec), "ablation folder", ConfigError)  # no config.json: nothing to keep
        copy_tree(source, spec.run_dir, "--reuse run", lambda name: name in (PROBE, REUSED) or name.endswith(".lock"),
                  error=ConfigError)
        write_json(spec.run_dir, Path(REUSED).stem, {"from": str(source.resolve())})
        log(f"{spec.cell} seed {spec.seed}: reused {source} (same config)")
        copied += 1
    return copied


def finished_runs(source: Path) -> list[tuple[Path, Path]]:
    """(source, run folder) of every finished run of the ablation folder `source` (OUT/runs/CELL/seed-K/ with an
    eval.json), listed through the door: a link out of `source`, on the way or as a run, is refused."""
    runs = []
    top = source / RUNS
    if not is_folder(top):
        check_inside(top, source, "--reuse folder", ConfigError)
        return runs
    for cell in list_folder(top, "--reuse folder", source, error=ConfigError):
        for seed in list_folder(cell.path, "--reuse folder", source, error=ConfigError) if is_folder(cell.path, source) else []:
            run = Path(seed.path)
            if seed.name.startswith("seed-") and is_folder(run, source) and is_regular(run / EVALUATION, source):
                runs.append((source, run))
    return runs


# --------------------------------------------------------------------------- one run


def run_state(spec: RunSpec) -> str:
    """"finished" (all steps trained and evaluated), "stopped" (on non-finite values: RUN/stopped.json), "killed"
    (config.json but neither) or "new"."""
    state = RunFolder(spec.run_dir).state(spec.config["train"]["steps"])
    return "stopped" if state == "killed" and is_regular(Path(spec.run_dir) / STOPPED, out_folder(spec)) else state


def stopped_record(spec: RunSpec) -> dict:
    """What a grid keeps of a run that stopped on non-finite values: which run, and why (its RUN/stopped.json)."""
    reason = read_run_json(Path(spec.run_dir) / STOPPED, out_folder(spec), dict, "reason", str)["reason"]
    return {"cell": spec.cell, "label": spec.label, "columns": spec.columns, "seed": spec.seed,
            "run_dir": relative_run_dir(spec), "stopped": reason}


def run_one(spec: RunSpec, threads: int = 0) -> dict:
    """Train (or resume) the run unless finished, probe it unless probed; returns its record.

    The trainer's console output goes to spec.log_file. Runs in a worker process with --jobs > 1.
    """
    import torch

    if threads:
        torch.set_num_threads(threads)
    run_dir, started = Path(spec.run_dir), time.perf_counter()
    state = run_state(spec)
    Path(spec.log_file).parent.mkdir(parents=True, exist_ok=True)
    with open(spec.log_file, "a") as log, contextlib.redirect_stdout(log):
        if state != "finished":
            from topoclip.run.training.trainer import train

            config = load_config(values=spec.config)
            try:
                if state == "killed":
                    train(config, resume=run_dir, progress=False)
                else:  # a folder without config.json holds nothing to keep; never deleted through a link
                    remove_tree(run_dir, out_folder(spec), "ablation folder", ConfigError)
                    run_dir.parent.mkdir(parents=True, exist_ok=True)
                    train(config, out_dir=run_dir, progress=False)
            except NonFiniteError as error:  # the grid goes on without it; a later ablate does not train it again
                print(f"topoclip: error: {error}")
                write_json(run_dir, Path(STOPPED).stem, {"reason": str(error)})
                return {**stopped_record(spec), "state_before": state, "seconds": time.perf_counter() - started}
        if spec.probe_size and not (run_dir / PROBE).is_file():
            probe_run(run_dir, spec.probe_size)
    record = run_record(spec)
    record.update(state_before=state, seconds=time.perf_counter() - started)
    return record


def probe_run(run_dir: Path, train_size: int) -> dict:
    """The linear probe of a finished run on the built-in shape task, written to RUN/probe.json."""
    from topoclip.analysis.inputs import load_model
    from topoclip.analysis.probe import probe_task, task_sets

    loaded = load_model(run_dir, device="auto")
    sets = task_sets(loaded, train_size, max(8, train_size // 4), max(8, train_size // 2))
    result = {"task": PROBE_TASK, **probe_task(loaded, PROBE_TASK, sets)}
    write_json(run_dir, "probe", result)
    return result


def run_record(spec: RunSpec) -> dict:
    """The numbers of one finished run: Table 6's columns plus every headline metric."""
    from topoclip.run.evaluation.run import headline, read_evaluation

    from topoclip.io.run_folder import read_metrics

    run_dir = Path(spec.run_dir)
    folder, out_dir = RunFolder(run_dir), out_folder(spec)
    records = read_evaluation(folder.evaluation, out_dir)  # checked: the records `evaluate` writes, their numbers numbers
    curve = read_curve(run_dir)
    metrics = read_metrics(folder.metrics)
    evaluations = [{"step": r["step"], **r["eval"]} for r in metrics
                   if "eval" in r and not r.get("final")]  # the validation split's; the final one is the test split's
    # A hyperbolic model's curvature, logged beside τ (the same records the τ curve reads).
    curvature = [r["curvature"] for r in metrics if "scale" in r and "t" in r and "curvature" in r]
    loss_scale = [r["loss_scale"] for r in metrics if "scale" in r and "t" in r and "loss_scale" in r]  # fp16
    retrieval = next((r["metrics"] for r in records if r["task"] == "zeroshot_retrieval"
                      and not r["dataset"].endswith("-ood")), {})
    classification = [r["metrics"] for r in records
                      if r["task"] == "zeroshot_classification" and r["dataset"] == spec.zero_shot_set]
    zero_shot = next((m for m in classification if m.get("mode") == "distance"), classification[0] if classification else {})
    probe = read_run_json(run_dir / PROBE, out_dir, dict, "test_top1", (int, float)) if (run_dir / PROBE).exists() else {}
    config = load_config(values=spec.config)
    model = config.model
    trains_tau = model.temperature.learnable and get_loss(config.train.loss).temperature  # a margin loss has no τ
    reused = read_run_json(run_dir / REUSED, out_dir, dict, "from", str)["from"] if (run_dir / REUSED).exists() else None
    out_dir = out_dir.resolve()  # paths are recorded relative to OUT, not to this machine
    return {"cell": spec.cell, "label": spec.label, "columns": spec.columns, "seed": spec.seed,
            "run_dir": relative_run_dir(spec),
            "model": describe_model(model), "t_init": model.temperature.init, "learnable": trains_tau,
            "final_t": curve.final_t, "convergence_step": curve.convergence_step, "window": curve.window,
            "i2t_r1": retrieval.get("text_retrieval_recall@1"), "t2i_r1": retrieval.get("image_retrieval_recall@1"),
            "zero_shot_top1": zero_shot.get("top1"), "linear_probe_top1": probe.get("test_top1"),
            "headline": headline(records), "curve": {"steps": curve.steps, "scale": curve.scale,
                                                     **({"curvature": curvature} if curvature else {}),
                                                     **({"loss_scale": loss_scale} if loss_scale else {})},
            "skipped_steps": skipped_steps(metrics),
            # every retrieval metric of the final evaluation (R@K, mean recall, mAP@R, R-Precision) per set
            "retrieval": {r["dataset"]: r["metrics"] for r in records if r["task"] == "zeroshot_retrieval"},
            "evaluations": evaluations,  # the periodic validation evaluations (train.eval_every), headline keys
            # wall time from the first start (config.json is written once, not on resume) to the final evaluation:
            # a run stopped and resumed later counts the pause
            "train_seconds": folder.evaluation.stat().st_mtime - folder.config.stat().st_mtime,
            "reused_from": os.path.relpath(reused, out_dir) if reused else None}


def skipped_steps(metrics: list[dict]) -> int:
    """The steps of a run skipped for a non-finite loss, from the trainer's running count in its log (logged once one
    happens). A checkpoint carries the count, so it only grows; a run resumed by a topoclip from before that started
    again from 0, which shows as a fall: each stretch's last count is added."""
    total = last = 0
    for record in (r for r in metrics if "loss" in r):  # the training steps' records (not the evaluations')
        count = record.get("skipped_steps", 0)
        total, last = total + (last if count < last else 0), count
    return total + last


def read_run_json(path: Path, out_dir: Path, expect: type, key: str, kind: Union[type, tuple]):
    """A JSON object a run of the ablation `out_dir` wrote (probe.json, reused.json), read through the door, its `key`
    of `kind`; damaged, it is one line naming the fix (delete it: the same command writes it again)."""
    try:
        value = read_json(path, "a run's file", out_dir, expect=expect, error=ConfigError)
        if not isinstance(value.get(key), kind) or isinstance(value.get(key), bool):
            raise ConfigError(f"{path}: its {key!r} is not what topoclip writes")
        return value
    except ConfigError as error:
        raise ConfigError(f"{error}; delete {path} and run the same command to write it again") from None


def relative_run_dir(spec: RunSpec) -> str:
    """"runs/CELL/seed-K": where a run lives inside its ablation folder."""
    return f"{RUNS}/{spec.cell}/seed-{spec.seed}"


# --------------------------------------------------------------------------- the command


def add_ablate_arguments(ablate) -> None:
    """`topoclip ablate`'s options on the argparse parser `ablate` (the command line's, and the report's reading of
    the command lines an ablation recorded: topoclip.experiments.results.files.run_settings)."""
    from topoclip.core.arguments import add_overrides, whole
    from topoclip.experiments.grid import grid_names

    ablate.add_argument("--grid", required=True, help=f"{', '.join(grid_names())}, or a grid JSON file")
    ablate.add_argument("--seeds", type=whole(1), default=3, help="seeds per cell (default 3)")
    ablate.add_argument("--first-seed", type=whole(0), default=0, help="the first seed (default 0): --seeds 5 "
                        "--first-seed 5 trains seeds 5-9, five more seeds for a grid whose folder has 0-4")
    ablate.add_argument("--steps", type=whole(1), help="train.steps of every run (default: the presets')")
    ablate.add_argument("--jobs", type=whole(1), default=1, help="runs trained at once, each in its own process")
    ablate.add_argument("--preset", help="replace every cell's base preset (e.g. tiny for a smoke test)")
    ablate.add_argument("--cells", nargs="+", metavar="PATTERN", help="only the cells whose folder name matches one "
                        "of these shell patterns, e.g. 'sphere_*' 'ps-inner_*' (a reduced grid)")
    ablate.add_argument("--probe-size", type=whole(0), default=1000, help="training images of each run's linear probe "
                        "(0: no probe)")
    ablate.add_argument("--out", help="output folder (default ablations/GRID); re-running it finishes what is missing")
    ablate.add_argument("--reuse", nargs="+", metavar="OUT", help="other ablation folders (e.g. a compare run's): "
                        "their finished runs whose config equals a cell's (name aside) are copied instead of trained")
    add_overrides(ablate)


def ablate(grid_name: Union[str, Grid], out_dir, seeds: int = 3, steps: Optional[int] = None, overrides: Sequence[str] = (),
           jobs: int = 1, preset: Optional[str] = None, probe_size: int = 1000, cells: Optional[Sequence[str]] = None,
           reuse: Sequence = (), command: Optional[str] = None, first_seed: int = 0,
           log: Callable[[str], None] = print) -> dict:
    """Train every missing run of the grid (J at a time), probe them, write the report; returns ablation.json's data.

    grid_name: a shipped grid's name or a grid file, or a Grid made in code.
    cells: shell patterns of cell names to run and tabulate (a reduced grid); None for every cell.
    reuse: other ablation folders whose finished runs with the same config are copied instead of trained.
    first_seed: the seeds are first_seed, ..., first_seed + seeds − 1.
    command: the command line to record with the results (the CLI passes its own).
    """
    if seeds < 1 or jobs < 1 or probe_size < 0 or first_seed < 0:
        raise ConfigError("--seeds and --jobs must be ≥ 1, --probe-size and --first-seed ≥ 0")
    grid = grid_name if isinstance(grid_name, Grid) else load_grid(grid_name)  # a Grid: one made in code (compare)
    out_dir = Path(out_dir)
    overrides = list(overrides) + ([f"train.steps={steps}"] if steps is not None else [])
    # One owner per ablation folder: a second ablate on the same --out would delete "new" run folders the
    # first is about to train, and write one's settings beside the other's results.
    with claim_folder(out_dir, "ablation folder"):
        specs = plan(grid, out_dir, seeds, overrides, preset, probe_size, cells, first_seed)
        started, clock, code = time.perf_counter(), datetime.datetime.now(datetime.timezone.utc), code_info()
        reused = reuse_runs(specs, reuse, log)
        log(f"ablate {grid.name}: {len(specs)} runs ({len(specs) // seeds} cells × {seeds} seeds); "
            f"logs in {out_dir / 'logs'}")
        records, trained = finish_runs(specs, jobs, probe_size, log)
        stopped = [{key: r[key] for key in ("cell", "seed", "run_dir", "stopped")} for r in records if "stopped" in r]
        records = [r for r in records if "stopped" not in r]
        for run in stopped:
            log(f"topoclip: note: {run['cell']} seed {run['seed']} stopped on non-finite values and is left out of the "
                f"table (delete {out_dir / run['run_dir'] / STOPPED} to train it again): {stopped_reason(run['stopped'])}")
        meta = {"grid": grid.name, "cells": list(cells) if cells else "all", "seeds": seeds, "first_seed": first_seed,
                "preset": preset or grid.preset, "steps": load_config(values=specs[0].config).train.steps,
                "command": command or (f"ablate({grid.name!r}, seeds={seeds}, first_seed={first_seed}, steps={steps}, "
                                       f"jobs={jobs}, preset={preset!r})"),
                "jobs": jobs, "started": clock.isoformat(timespec="seconds"), "wall_seconds": time.perf_counter() - started,
                "trained_now": trained, "reused_now": reused,
                "reused": sum(r["reused_from"] is not None for r in records), "stopped": stopped,
                "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                            "python": platform.python_version(), **_torch_info()}, "code": code}
        return write_report(grid, records, meta, out_dir, log)


def finish_runs(specs: Sequence[RunSpec], jobs: int, probe_size: int, log: Callable[[str], None]) -> tuple[list, int]:
    """Train (or resume) every unfinished run and probe every unprobed one, `jobs` at a time.

    Returns every spec's record, in plan order, and how many runs were trained.
    """
    states = {s.run_dir: run_state(s) for s in specs}
    todo = [s for s in specs if states[s.run_dir] not in ("finished", "stopped")
            or (states[s.run_dir] == "finished" and probe_size and not (Path(s.run_dir) / PROBE).is_file())]
    to_train = sum(states[s.run_dir] != "finished" for s in todo)  # the rest only need their probe
    log(f"{len(specs) - len(todo)} already done, {len(todo)} to run ({len(todo) - to_train} of them only to probe), "
        f"{jobs} at a time")
    by_dir = {}
    for done, record in enumerate(_execute(todo, jobs), start=1):
        by_dir[record["run_dir"]] = record
        log(f"[{done}/{len(todo)}] {record['cell']} seed {record['seed']}: {record['state_before']} -> "
            f"{'stopped on non-finite values' if 'stopped' in record else 'finished'} in {record['seconds']:.0f} s")
    records = [by_dir.get(relative_run_dir(s)) or (stopped_record(s) if states[s.run_dir] == "stopped" else run_record(s))
               for s in specs]  # (a state other than "finished" or "stopped" was trained above)
    for record in records:
        record.pop("state_before", None)
    return records, to_train


def package_digest(package: Path) -> str:
    """sha256 of a topoclip package folder's own files (.py and .json: code, presets, grids; linked folders followed),
    each with its relative path and size: the same for the same code however it was installed (a checkout, a wheel, a
    pinned copy on PYTHONPATH). A file that cannot be read counts by its name."""
    import hashlib

    digest = hashlib.sha256()
    files = sorted(Path(folder, name) for folder, _, names in os.walk(package, followlinks=True)
                   if "__pycache__" not in Path(folder).parts for name in names if name.endswith((".py", ".json")))
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            data = b"unreadable"
        digest.update(f"{path.relative_to(package).as_posix()}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()


def code_info() -> dict:
    """Which topoclip this is, read when an ablation starts: its version, its files' digest (package_digest) and, run
    from a git checkout of this project, the commit and whether the package's files differ from it (None where git,
    or such a checkout, is absent)."""
    import topoclip

    package = Path(topoclip.__file__).resolve().parent
    info = {"topoclip": topoclip.__version__, "sha256": package_digest(package), "commit": None, "modified": None}

    def git(*args: str) -> str:  # no optional locks: a commit made meanwhile in the checkout is not blocked
        return subprocess.run(["git", "--no-optional-locks", "-C", str(package), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() / "src" / "topoclip" == package:  # not another repo's
            info["commit"] = git("rev-parse", "HEAD")
            info["modified"] = bool(git("status", "--porcelain", "--untracked-files=normal", "--", "."))
    except (OSError, subprocess.SubprocessError):  # no git, not a checkout, or one git will not read (another owner's)
        pass
    return info


def _torch_info() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _execute(specs: Sequence[RunSpec], jobs: int):
    """Yield each run's record as it finishes: in this process for one job, else in `jobs` spawned processes."""
    if jobs == 1 or len(specs) <= 1:
        for spec in specs:
            yield run_one(spec)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    threads = max(1, (os.cpu_count() or 1) // jobs)
    # spawn, not fork: a forked child of a process that already ran torch's thread pools can hang.
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=die_with_parent, initargs=(os.getpid(),))
    try:
        futures = [pool.submit(run_one, spec, threads) for spec in specs]
        for future in as_completed(futures):
            yield future.result()
    except BaseException:  # Ctrl-C, an error, or the caller stopping: end the runs now, not after they finish
        for process in list(getattr(pool, "_processes", {}).values()):
            process.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()


# How often a child checks that its parent still lives where the kernel cannot tell it (not Linux).
PARENT_POLL_SECONDS = 1.0


def die_with_parent(parent: int) -> None:
    """In a --jobs child: end when the ablate process that started it ends, however it ends (kill -9 too).

    On Linux the kernel sends SIGKILL to the child when its parent dies (prctl PR_SET_PDEATHSIG); the run
    it trains loses nothing a kill loses (checkpoints are atomic, the run folder's lock ends with it, and
    a re-run of the ablate resumes it). Elsewhere a daemon thread polls the parent's pid.
    """
    import signal
    import threading

    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            raise OSError
    except (OSError, AttributeError):
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(PARENT_POLL_SECONDS)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)
