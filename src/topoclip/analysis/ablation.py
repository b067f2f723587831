"""Ablation grids: presets × settings × seeds, trained, probed and tabulated like the paper's Table 6.

A grid is JSON data in ``topoclip/analysis/grids/NAME.json`` (or any JSON file of that shape)::

    {"description": "...",
     "preset": "cpu-sphere",                       base preset of every cell (a level may name its own)
     "settings": ["model.temperature.max_scale=250"],   --set overrides of every cell
     "zero_shot_set": "shape",                     the built-in set of the "zero-shot top-1" column
     "axes": [{"name": "topology", "show": false,  show: a column of its own in the table
               "levels": [{"label": "sphere", "preset": "...", "set": ["model.topology=sphere", ...],
                           "logit_range_like": "<label of another level of this axis>"}, ...]}, ...],
     "paper": {"source": "which table, and how its metrics map to ours",   optional: the paper's numbers,
               "rows": {"<cell folder name>": {"model": "Ob(64,8)", "final_t": 2.231, ...Table 6's columns}}}}

The cells are the product of the axes' levels. A cell's config is, in order: its preset (the
``--preset`` option replaces every one, e.g. ``tiny`` for a smoke test), the grid's settings, each
level's settings, the user's ``--set``, then ``train.seed`` = the seed. ``logit_range_like: L``
sets t's init so that the cell's initial logit range τ·(s_max − s_min)/2 equals that of the cell
with level L instead (both resolved the same way): t = t_L + ln(half-range_L / half-range), e.g.
a sum of m cosines against the sphere: t = 2.659 − ln m.

Runs live in ``OUT/runs/CELL/seed-K/`` (the trainer's run folders). **Resumable**: a run whose
eval.json exists is finished and is not trained again; a run folder with a config.json but no
eval.json (killed) is resumed from its newest checkpoint; anything else starts afresh. A folder
made with other settings is refused (use another OUT). ``--jobs J`` trains J runs at once in
separate processes (each with cores / J threads). After training, each run gets a linear probe
(``probe.json`` beside eval.json, also resumable). Then ``OUT/table.md`` (mean ± std over seeds,
the columns of Table 6), ``OUT/ablation.json`` (every run and every row, the command, the
machine, the wall time) and ``OUT/temperature.png`` (every run's τ, one colour per cell).
"""
from __future__ import annotations

import contextlib
import fnmatch
import itertools
import json
import math
import os
import platform
import re
import shutil
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable, Optional, Sequence

from topoclip.analysis.output import write_json
from topoclip.analysis.statistics import mean_std, paired
from topoclip.analysis.temperature import TOLERANCE, plot_curves, read_curve
from topoclip.config import Config, ConfigError, ModelConfig, load_config, to_dict
from topoclip.training.run_folder import claim_folder

GRIDS_PACKAGE = "topoclip.analysis.grids"
PROBE_TASK = "shape"
RUNS = "runs"
EVAL = "eval.json"
PROBE = "probe.json"
REUSED = "reused.json"  # in a run folder copied from another ablation: where from
LABEL_KEYS = {"name"}  # top-level config keys that only label a run (its default folder name), never change it


# --------------------------------------------------------------------------- grids as data


@dataclass
class Level:
    """One value of one axis: a label, optionally a preset, the settings it applies."""

    axis: str
    label: str
    preset: Optional[str] = None
    settings: list[str] = field(default_factory=list)
    logit_range_like: Optional[str] = None


@dataclass
class Axis:
    name: str
    levels: list[Level]
    show: bool = True  # a column of its own in the table


@dataclass
class Grid:
    name: str
    description: str
    preset: str
    settings: list[str]
    axes: list[Axis]
    zero_shot_set: str = "shape"
    paper: dict = field(default_factory=dict)  # {"source": ..., "rows": {cell name: the paper's numbers}}

    def cells(self) -> list[tuple[Level, ...]]:
        """Every combination of one level per axis, in the order the axes list them."""
        return list(itertools.product(*(axis.levels for axis in self.axes)))


def grid_names() -> list[str]:
    """The grids shipped with topoclip."""
    return sorted(Path(p.name).stem for p in resources.files(GRIDS_PACKAGE).iterdir() if p.name.endswith(".json"))


def load_grid(name: str) -> Grid:
    """A shipped grid by name, or a grid JSON file."""
    shipped = {Path(p.name).stem: p for p in resources.files(GRIDS_PACKAGE).iterdir() if p.name.endswith(".json")}
    if name in shipped:
        values, grid_name = json.loads(shipped[name].read_text()), name
    elif Path(name).is_file():
        values, grid_name = json.loads(Path(name).read_text()), Path(name).stem
    else:
        raise ConfigError(f"unknown grid {name!r}; choose one of {grid_names()} or give a grid JSON file")
    try:
        axes = [Axis(a["name"], [Level(a["name"], lv["label"], lv.get("preset"), list(lv.get("set", [])),
                                       lv.get("logit_range_like")) for lv in a["levels"]], a.get("show", True))
                for a in values["axes"]]
        return Grid(grid_name, values.get("description", ""), values["preset"], list(values.get("settings", [])),
                    axes, values.get("zero_shot_set", "shape"), values.get("paper", {}))
    except (KeyError, TypeError) as error:
        raise ConfigError(f"grid {name!r} is malformed: missing {error}; see topoclip.analysis.ablation") from None


def slug(text: str) -> str:
    """A folder-safe name: lower case, letters, digits, dots; runs of anything else become one '-'."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "cell"


def cell_name(levels: Sequence[Level]) -> str:
    return "_".join(slug(level.label) for level in levels)


def cell_label(levels: Sequence[Level]) -> str:
    return " / ".join(level.label for level in levels)


def describe_model(model: ModelConfig) -> str:
    """"Sphere(128)", "Euclidean R^128", "PS(16,8)", "PS(16,8) geodesic", "Multi(16,8)"."""
    m, n, d = model.sphere_count, model.sphere_dim, model.class_tokens * model.embed_dim
    if model.topology == "sphere":
        return f"Sphere({d})" + (f", {model.class_tokens} tokens" if model.class_tokens > 1 else "")
    if model.topology == "euclidean":
        return f"Euclidean R^{d}" + (f", {model.class_tokens} tokens" if model.class_tokens > 1 else "")
    shape = f"Multi({n},{m})" if model.class_tokens > 1 else f"PS({n},{m})"
    return shape + (" geodesic" if model.topology == "ps-geodesic" else "")


# --------------------------------------------------------------------------- planning


def half_range(model: ModelConfig) -> float:
    """(s_max − s_min) / 2 of the model's similarity; refused for an unbounded one (euclidean)."""
    from topoclip.geometry import get_topology

    low, high = get_topology(model.topology).similarity_range(model.sphere_count)
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ConfigError(f"logit_range_like needs a bounded similarity; {model.topology} has the range ({low}, {high})")
    return (high - low) / 2


def cell_config(grid: Grid, levels: Sequence[Level], overrides: Sequence[str], seed: int,
                preset: Optional[str] = None) -> Config:
    """The resolved config of one cell and seed (see the module docstring for the order)."""
    def resolve(chosen: Sequence[Level], extra: Sequence[str] = ()) -> Config:
        base = preset or next((lv.preset for lv in reversed(chosen) if lv.preset), None) or grid.preset
        settings = list(grid.settings) + [s for lv in chosen for s in lv.settings] + list(overrides) + list(extra)
        name = f"{grid.name}-{cell_name(chosen)}-seed{seed}"
        return load_config(base, settings + [f"train.seed={seed}"], values={"name": name})

    config = resolve(levels)
    for index, level in enumerate(levels):
        if not level.logit_range_like:
            continue
        axis = next(a for a in grid.axes if a.name == level.axis)
        reference = next((lv for lv in axis.levels if lv.label == level.logit_range_like), None)
        if reference is None or reference.logit_range_like:
            raise ConfigError(f"grid {grid.name}: level {level.label!r} has logit_range_like={level.logit_range_like!r}, "
                              f"which must name another level of axis {axis.name!r} without one of its own")
        other = resolve([*levels[:index], reference, *levels[index + 1:]])
        t_init = other.model.temperature.init + math.log(half_range(other.model) / half_range(config.model))
        config = resolve(levels, [f"model.temperature.init={t_init!r}"])
    return config


@dataclass
class RunSpec:
    """One training run of the grid: everything a worker process needs (picklable)."""

    cell: str  # folder-safe name
    label: str  # "sphere / t 2.659"
    columns: dict  # axis name -> level label, for the shown axes
    seed: int
    run_dir: str
    log_file: str
    config: dict  # to_dict(Config)
    probe_size: int  # training images of the probe; 0 = no probe
    zero_shot_set: str


def select_cells(grid: Grid, patterns: Optional[Sequence[str]] = None) -> list[tuple[Level, ...]]:
    """The grid's cells whose folder name matches one of the shell patterns (all cells without patterns)."""
    cells = grid.cells()
    if not patterns:
        return cells
    chosen = [levels for levels in cells if any(fnmatch.fnmatchcase(cell_name(levels), p) for p in patterns)]
    if not chosen:
        raise ConfigError(f"--cells {' '.join(patterns)} matches no cell of grid {grid.name}; its cells are "
                          + ", ".join(cell_name(levels) for levels in cells))
    return chosen


def plan(grid: Grid, out_dir, seeds: int, overrides: Sequence[str] = (), preset: Optional[str] = None,
         probe_size: int = 1000, cells: Optional[Sequence[str]] = None) -> list[RunSpec]:
    """Every (cell, seed) run of the grid (or of the cells matching `cells`) with its resolved config.

    Refuses a run folder that was made with other settings.
    """
    out_dir = Path(out_dir)
    specs = []
    for levels in select_cells(grid, cells):
        columns = {lv.axis: lv.label for lv, axis in zip(levels, grid.axes) if axis.show}
        for seed in range(seeds):
            config = cell_config(grid, levels, overrides, seed, preset)
            run_dir = out_dir / RUNS / cell_name(levels) / f"seed-{seed}"
            spec = RunSpec(cell_name(levels), cell_label(levels), columns, seed, str(run_dir),
                           str(out_dir / "logs" / f"{cell_name(levels)}-seed-{seed}.log"),
                           json.loads(json.dumps(to_dict(config))), probe_size, grid.zero_shot_set)
            check_existing(spec)
            specs.append(spec)
    return specs


def check_existing(spec: RunSpec) -> None:
    """A run folder with a config.json must have been made with exactly this config."""
    saved_path = Path(spec.run_dir) / "config.json"
    if not saved_path.is_file():
        return
    saved = json.loads(saved_path.read_text())
    differences = sorted(_differences(saved, spec.config))
    if differences:
        raise ConfigError(f"{spec.run_dir} was made with other settings ({', '.join(differences[:3])}"
                          f"{', …' if len(differences) > 3 else ''} differ); use another --out, or delete that folder")


def _differences(saved, wanted, prefix: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(wanted, dict):
        keys = (set(saved) | set(wanted)) - (LABEL_KEYS if not prefix else set())
        return [d for key in keys for d in _differences(saved.get(key), wanted.get(key), f"{prefix}{key}.")]
    return [] if saved == wanted else [prefix.rstrip(".")]


def reuse_runs(specs: Sequence[RunSpec], sources: Sequence, log: Callable[[str], None] = print) -> int:
    """Copy in every run of `specs` not started yet that another ablation folder has finished with the same config.

    sources: ablation output folders (their OUT/runs/*/seed-*/). A finished run (eval.json) whose config.json
    equals the spec's config, the run's name aside, is copied whole, except its probe (re-run at this grid's
    --probe-size), and gets RUN/reused.json naming its source. Returns the number of runs copied.
    """
    finished = [path.parent for source in sources for path in sorted(Path(source).glob(f"{RUNS}/*/seed-*/{EVAL}"))]
    if sources and not finished:
        raise ConfigError(f"--reuse {' '.join(map(str, sources))}: no finished run there (expected OUT/{RUNS}/CELL/seed-K/{EVAL})")
    configs = {run: json.loads((run / "config.json").read_text()) for run in finished}
    copied = 0
    for spec in specs:
        source = next((run for run, config in configs.items() if not _differences(config, spec.config)), None)
        if source is None or run_state(spec) != "new" or Path(spec.run_dir).resolve() == source.resolve():
            continue
        shutil.rmtree(spec.run_dir, ignore_errors=True)  # a folder without config.json holds nothing to keep
        shutil.copytree(source, spec.run_dir, ignore=shutil.ignore_patterns(PROBE, REUSED, "*.lock"))
        write_json(spec.run_dir, Path(REUSED).stem, {"from": str(source.resolve())})
        log(f"{spec.cell} seed {spec.seed}: reused {source} (same config)")
        copied += 1
    return copied


# --------------------------------------------------------------------------- one run


def run_state(spec: RunSpec) -> str:
    """"finished" (eval.json there), "killed" (config.json but no eval.json) or "new"."""
    run_dir = Path(spec.run_dir)
    if (run_dir / EVAL).is_file():
        return "finished"
    if (run_dir / "config.json").is_file():
        return "killed"
    return "new"


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
            from topoclip.training.trainer import train

            config = load_config(values=spec.config)
            if state == "killed":
                train(config, resume=run_dir, progress=False)
            else:
                shutil.rmtree(run_dir, ignore_errors=True)  # a folder without config.json holds nothing to keep
                run_dir.parent.mkdir(parents=True, exist_ok=True)
                train(config, out_dir=run_dir, progress=False)
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
    from topoclip.evaluation.run import headline

    from topoclip.training.logger import read_metrics

    run_dir = Path(spec.run_dir)
    records = json.loads((run_dir / EVAL).read_text())
    curve = read_curve(run_dir)
    evaluations = [{"step": r["step"], **r["eval"]} for r in read_metrics(run_dir / "metrics.jsonl")
                   if "eval" in r and not r.get("final")]  # the validation split's; the final one is the test split's
    retrieval = next((r["metrics"] for r in records if r["task"] == "zeroshot_retrieval"
                      and not r["dataset"].endswith("-ood")), {})
    classification = [r["metrics"] for r in records
                      if r["task"] == "zeroshot_classification" and r["dataset"] == spec.zero_shot_set]
    zero_shot = next((m for m in classification if m.get("mode") == "distance"), classification[0] if classification else {})
    probe = json.loads((run_dir / PROBE).read_text()) if (run_dir / PROBE).is_file() else {}
    model = load_config(values=spec.config).model
    reused = json.loads((run_dir / REUSED).read_text())["from"] if (run_dir / REUSED).is_file() else None
    out_dir = run_dir.resolve().parents[2]  # OUT/runs/CELL/seed-K: paths are recorded relative to OUT, not to this machine
    return {"cell": spec.cell, "label": spec.label, "columns": spec.columns, "seed": spec.seed,
            "run_dir": relative_run_dir(spec),
            "model": describe_model(model), "t_init": model.temperature.init, "learnable": model.temperature.learnable,
            "final_t": curve.final_t, "convergence_step": curve.convergence_step, "window": curve.window,
            "i2t_r1": retrieval.get("text_retrieval_recall@1"), "t2i_r1": retrieval.get("image_retrieval_recall@1"),
            "zero_shot_top1": zero_shot.get("top1"), "linear_probe_top1": probe.get("test_top1"),
            "headline": headline(records), "curve": {"steps": curve.steps, "scale": curve.scale},
            "evaluations": evaluations,  # the periodic validation evaluations (train.eval_every), headline keys
            # wall time from the (last) start, when config.json is written, to the final evaluation
            "train_seconds": (run_dir / EVAL).stat().st_mtime - (run_dir / "config.json").stat().st_mtime,
            "reused_from": os.path.relpath(reused, out_dir) if reused else None}


def relative_run_dir(spec: RunSpec) -> str:
    """"runs/CELL/seed-K": where a run lives inside its ablation folder."""
    return f"{RUNS}/{spec.cell}/seed-{spec.seed}"


# --------------------------------------------------------------------------- the table


def _format(values: Sequence[Optional[float]], digits: int) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "—"
    mean, std = mean_std(present)
    text = f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if len(present) > 1 else "")
    return text + (f" ({len(present)}/{len(values)})" if len(present) < len(values) else "")


# "Still rising?" compares each run's last periodic evaluation with its evaluation this fraction of the
# run earlier (a paired t over the cell's seeds): under a cosine schedule the last quarter has under 15 %
# of the peak learning rate, so a metric that still climbs there was cut off by the schedule, not converged.
LATE_FRACTION = 0.25


def curve_metrics(zero_shot_set: str) -> dict[str, str]:
    """{title: key of a periodic evaluation}: what the curves show and the late-rise test reads."""
    return {f"zero-shot top-1 ({zero_shot_set})": f"{zero_shot_set}/distance/top1",
            "held-out compositions top-1": "composition-held-out/distance/top1",
            "retrieval mean recall (val)": "scenes-val/mean_recall"}


def late_rise(runs: Sequence[dict], key: str, steps: int) -> Optional[dict]:
    """Paired t of `key` at the runs' last periodic evaluation against the one nearest LATE_FRACTION of the
    run before it; None unless ≥ 2 runs have both."""
    logged = [{e["step"]: e[key] for e in run.get("evaluations", []) if key in e} for run in runs]
    common = sorted(set.intersection(*(set(points) for points in logged))) if logged else []
    if len(runs) < 2 or len(common) < 2:
        return None
    last = common[-1]
    earlier = min(common[:-1], key=lambda step: abs(step - (last - LATE_FRACTION * steps)))
    difference = paired([points[last] for points in logged], [points[earlier] for points in logged])
    return {"from_step": earlier, "to_step": last, **difference.as_dict()}


def summary_rows(records: Sequence[dict], steps: int = 0, zero_shot_set: str = "shape") -> list[dict]:
    """One row per cell (in plan order): mean ± std over its seeds of every Table 6 column, and the late rise
    of each curve metric (`late_rise`; needs the runs' periodic evaluations and the schedule's `steps`)."""
    cells = list(dict.fromkeys(r["cell"] for r in records))
    rows = []
    for cell in cells:
        runs = [r for r in records if r["cell"] == cell]
        first = runs[0]
        numbers = {key: [r[key] for r in runs] for key in
                   ("final_t", "convergence_step", "i2t_r1", "t2i_r1", "zero_shot_top1", "linear_probe_top1")}
        row = {"cell": cell, "label": first["label"], "columns": first["columns"], "model": first["model"],
               "t_init": first["t_init"], "learnable": first["learnable"], "seeds": [r["seed"] for r in runs]}
        for key, values in numbers.items():
            present = [v for v in values if v is not None]
            mean, std = mean_std(present) if present else (None, None)
            row[key] = {"mean": mean, "std": std, "count": len(present), "values": values}
        row["late_rise"] = {key: late_rise(runs, key, steps) for key in curve_metrics(zero_shot_set).values()}
        rows.append(row)
    return rows


def markdown_table(grid: Grid, rows: Sequence[dict], meta: dict) -> str:
    """Table 6's columns (plus the grid's shown axes) as a markdown document."""
    shown = [axis.name for axis in grid.axes if axis.show]
    header = (["model"] + shown + ["t init", "learnable", "final t", "convergence step", "I2T R@1", "T2I R@1",
              f"zero-shot top-1 ({grid.zero_shot_set})", "still rising?", f"linear probe ({PROBE_TASK})"])
    lines = [f"# Ablation `{grid.name}`", "", grid.description, "",
             ("" if meta["cells"] == "all" else f"Reduced grid: the cells matching {' '.join(meta['cells'])}. ")
             + (f"{meta['reused']} of the {len(rows) * meta['seeds']} runs are copies of runs of other ablations made "
                f"with the same config (`--reuse`; `reused_from` in ablation.json). " if meta.get("reused") else "")
             + f"Mean ± sample std over n = {meta['seeds']} seed(s) (train.seed 0 … {meta['seeds'] - 1}); base preset "
             f"`{meta['preset']}`; {meta['steps']} steps; command `{meta['command']}`. "
             f"Retrieval: built-in scenes test split (in-domain), R@1 in %; zero-shot: the `{grid.zero_shot_set}` set, "
             f"distance mode; linear probe: L-BFGS logistic regression on the frozen class-token features "
             f"(`topoclip analyze probe`). Convergence step: first logged step after which τ stays within "
             f"{TOLERANCE:.0%} of its value for a window W (one epoch, at most a quarter of the run; "
             f"`topoclip analyze temperature`), averaged over the seeds that converged ((k/n) when not all did). "
             f"Still rising?: the zero-shot top-1 of the periodic validation evaluations at the last one against "
             f"the one {LATE_FRACTION:.0%} of the run before (paired t over the seeds): \"yes\" when its 95 % "
             f"interval, shown, is above 0; \"—\" without periodic evaluations."
             + (f" Rows in italics are the paper's, from its {grid.paper['source']}" if grid.paper else ""), "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        def column(key: str, digits: int) -> str:
            return _format(row[key]["values"], digits)

        convergence = column("convergence_step", 0) if row["learnable"] else "fixed"
        cells = ([row["model"]] + [row["columns"][name] for name in shown]
                 + [f"{row['t_init']:.3f}", "yes" if row["learnable"] else "no", column("final_t", 3), convergence,
                    column("i2t_r1", 1), column("t2i_r1", 1), column("zero_shot_top1", 1),
                    still_rising(row, grid.zero_shot_set), column("linear_probe_top1", 1)])
        lines.append("| " + " | ".join(cells) + " |")
        paper = grid.paper.get("rows", {}).get(row["cell"])
        if paper:
            def number(key: str, digits: int) -> str:
                return "—" if paper.get(key) is None else f"*{paper[key]:.{digits}f}*"

            cells = ([f"*paper: {paper['model']}*"] + [""] * len(shown)
                     + [f"*{row['t_init']:.3f}*", "", number("final_t", 3), f"*{paper.get('convergence_step') or '—'}*",
                        number("i2t_r1", 1), number("t2i_r1", 2), number("zero_shot_top1", 2), "",
                        number("linear_probe_top1", 2)])
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def still_rising(row: dict, zero_shot_set: str) -> str:
    """"yes +4.2 (+1.0 to +7.4)" / "no +0.3 (-1.2 to +1.8)" from the row's late rise of the zero-shot set."""
    rise = row.get("late_rise", {}).get(curve_metrics(zero_shot_set)[f"zero-shot top-1 ({zero_shot_set})"])
    if not rise:
        return "—"
    return f"{'yes' if rise['low'] > 0 else 'no'} {rise['effect']:+.1f} ({rise['low']:+.1f} to {rise['high']:+.1f})"


def plot_evaluations(records: Sequence[dict], out_dir, zero_shot_set: str) -> Optional[Path]:
    """OUT/curves.png: each curve metric and τ against the step, one line per cell (mean over its seeds, band
    ± sample std); None when no run has periodic evaluations."""
    from topoclip.analysis.output import pyplot, save_figure

    if not any(r.get("evaluations") for r in records):
        return None
    plt = pyplot()
    metrics = curve_metrics(zero_shot_set)
    figure, axes = plt.subplots(1, len(metrics) + 1, figsize=(4.4 * (len(metrics) + 1), 3.6), squeeze=False)
    cells = list(dict.fromkeys(r["label"] for r in records))
    colours = plt.get_cmap("tab10" if len(cells) <= 10 else "tab20")
    for index, cell in enumerate(cells):
        runs = [r for r in records if r["label"] == cell]
        for axis, key in zip(axes[0], metrics.values()):
            series = [{e["step"]: e[key] for e in r.get("evaluations", []) if key in e} for r in runs]
            _mean_band(axis, series, colours(index), cell)
        _mean_band(axes[0][-1], [dict(zip(r["curve"]["steps"], r["curve"]["scale"])) for r in runs], colours(index), cell)
    for axis, title in zip(axes[0], [*metrics, "τ (learned scale)"]):
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    axes[0][-1].set_yscale("log")
    axes[0][0].legend(fontsize=7)
    figure.suptitle(f"periodic validation evaluations, mean ± std over seeds ({len(records)} runs)", fontsize=10)
    return save_figure(figure, out_dir, "curves")


def _mean_band(axis, series: Sequence[dict], colour, label: str) -> None:
    """Mean ± sample std at the steps every series has."""
    steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
    if not steps:
        return
    means, stds = zip(*(mean_std([s[step] for s in series]) for step in steps))
    axis.plot(steps, means, color=colour, label=label, linewidth=1.4)
    axis.fill_between(steps, [m - d for m, d in zip(means, stds)], [m + d for m, d in zip(means, stds)],
                      color=colour, alpha=0.18, linewidth=0)


def plot_temperatures(records: Sequence[dict], out_dir) -> Path:
    """OUT/temperature.png: every run's t, one colour per cell, one panel per model (as the paper's Fig. 4)."""
    curves = [read_curve(Path(out_dir) / r["run_dir"]) for r in records]
    return plot_curves(curves, out_dir, "temperature", groups=[r["label"] for r in records],
                       panels=[r["model"] for r in records])


# --------------------------------------------------------------------------- the command


def ablate(grid_name: str, out_dir, seeds: int = 3, steps: Optional[int] = None, overrides: Sequence[str] = (),
           jobs: int = 1, preset: Optional[str] = None, probe_size: int = 1000, cells: Optional[Sequence[str]] = None,
           reuse: Sequence = (), command: Optional[str] = None, log: Callable[[str], None] = print) -> dict:
    """Train every missing run of the grid (J at a time), probe them, write table.md, ablation.json, temperature.png.

    cells: shell patterns of cell names to run and tabulate (a reduced grid); None for every cell.
    reuse: other ablation folders whose finished runs with the same config are copied instead of trained.
    command: the command line to record with the results (the CLI passes its own).
    """
    if seeds < 1 or jobs < 1 or probe_size < 0:
        raise ConfigError("--seeds and --jobs must be ≥ 1 and --probe-size ≥ 0")
    grid = load_grid(grid_name)
    out_dir = Path(out_dir)
    # One owner per ablation folder: a second ablate on the same --out would delete "new" run folders the
    # first is about to train, and write one's settings beside the other's results.
    with claim_folder(out_dir, "ablation folder"):
        return _ablate(grid, grid_name, out_dir, seeds, steps, overrides, jobs, preset, probe_size, cells, reuse,
                       command, log)


def _ablate(grid: Grid, grid_name: str, out_dir: Path, seeds: int, steps: Optional[int], overrides: Sequence[str],
            jobs: int, preset: Optional[str], probe_size: int, cells: Optional[Sequence[str]], reuse: Sequence,
            command: Optional[str], log: Callable[[str], None]) -> dict:
    overrides = list(overrides) + ([f"train.steps={steps}"] if steps is not None else [])
    specs = plan(grid, out_dir, seeds, overrides, preset, probe_size, cells)
    started = time.perf_counter()
    reused = reuse_runs(specs, reuse, log)
    todo = [s for s in specs if run_state(s) != "finished" or (probe_size and not (Path(s.run_dir) / PROBE).is_file())]
    to_train = sum(run_state(s) != "finished" for s in todo)  # the rest only need their probe
    log(f"ablate {grid.name}: {len(specs)} runs ({len(specs) // seeds} cells × {seeds} seeds), "
        f"{len(specs) - len(todo)} already done, {len(todo)} to run ({len(todo) - to_train} of them only to probe), "
        f"{jobs} at a time; logs in {out_dir / 'logs'}")
    by_dir = {}
    for done, record in enumerate(_execute(todo, jobs), start=1):
        by_dir[record["run_dir"]] = record
        log(f"[{done}/{len(todo)}] {record['cell']} seed {record['seed']}: {record['state_before']} -> finished "
            f"in {record['seconds']:.0f} s")
    records = [by_dir.get(relative_run_dir(s)) or run_record(s) for s in specs]
    for record in records:
        record.pop("state_before", None)
    steps_of_run = load_config(values=specs[0].config).train.steps
    rows = summary_rows(records, steps_of_run, grid.zero_shot_set)
    meta = {"grid": grid.name, "cells": list(cells) if cells else "all", "seeds": seeds, "preset": preset or grid.preset,
            "steps": steps_of_run,
            "command": command or f"ablate({grid_name!r}, seeds={seeds}, steps={steps}, jobs={jobs}, preset={preset!r})",
            "jobs": jobs, "wall_seconds": time.perf_counter() - started, "trained_now": to_train, "reused_now": reused,
            "reused": sum(r["reused_from"] is not None for r in records),
            "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                        "python": platform.python_version(), **_torch_info()}}
    (out_dir / "table.md").write_text(markdown_table(grid, rows, meta))
    plots = [plot for plot in (plot_temperatures(records, out_dir), plot_evaluations(records, out_dir, grid.zero_shot_set))
             if plot]
    result = {"analysis": "ablation", **meta, "description": grid.description, "rows": rows, "runs": records,
              "plots": [plot.name for plot in plots], "table": "table.md"}
    write_json(out_dir, "ablation", result)
    log(f"wrote {out_dir / 'table.md'}, {out_dir / 'ablation.json'}, {', '.join(map(str, plots))}")
    return result


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
