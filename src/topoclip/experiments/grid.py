"""Ablation grids as data: the cells (presets × settings), each cell's resolved config, and the run plan.

A grid is JSON data in ``topoclip/experiments/grids/NAME.json`` (or any JSON file of that shape)::
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

Runs live in ``OUT/runs/CELL/seed-K/`` (the trainer's run folders); `plan` refuses a folder made with
other settings. `topoclip.experiments.runner` trains a plan, `topoclip.experiments.report` tabulates it.
"""
from __future__ import annotations

import fnmatch
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Optional, Sequence

from topoclip.config import Config, ConfigError, ModelConfig, from_dict, load_config, to_dict
from topoclip.run_folder import RunFolder

GRIDS_PACKAGE = "topoclip.experiments.grids"
RUNS = "runs"
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
        try:
            values, grid_name = json.loads(Path(name).read_text(encoding="utf-8")), Path(name).stem
        except (ValueError, RecursionError) as error:  # not JSON, not UTF-8, nested too deeply
            raise ConfigError(f"grid file {name} is not valid JSON ({str(error)[:200] or 'nested too deeply'})") from None
    else:
        raise ConfigError(f"unknown grid {name!r}; choose one of {grid_names()} or give a grid JSON file")
    try:
        axes = [Axis(a["name"], [Level(a["name"], lv["label"], lv.get("preset"), list(lv.get("set", [])),
                                       lv.get("logit_range_like")) for lv in a["levels"]], a.get("show", True))
                for a in values["axes"]]
        grid = Grid(grid_name, values.get("description", ""), values["preset"], list(values.get("settings", [])),
                    axes, values.get("zero_shot_set", "shape"), values.get("paper", {}))
    except (KeyError, TypeError, AttributeError) as error:
        raise ConfigError(f"grid {name!r} is malformed ({type(error).__name__}: {error}); see "
                          f"topoclip.experiments.grid") from None
    bad = [axis.name for axis in grid.axes if not axis.levels or not all(
        isinstance(level.label, str) and level.label for level in axis.levels)]
    if not grid.axes or bad or not isinstance(grid.preset, str):
        raise ConfigError(f"grid {name!r} is malformed: every axis needs levels with text labels "
                          f"({'axis ' + repr(bad[0]) if bad else 'no axes or no preset'}); see topoclip.experiments.grid")
    return grid


def slug(text: str) -> str:
    """A folder-safe name: lower case, letters, digits, dots; runs of anything else become one '-'."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "cell"


def cell_name(levels: Sequence[Level]) -> str:
    return "_".join(slug(level.label) for level in levels)


def cell_label(levels: Sequence[Level]) -> str:
    return " / ".join(level.label for level in levels)


# --------------------------------------------------------------------------- planning


def half_range(model: ModelConfig) -> float:
    """(s_max − s_min) / 2 of the model's similarity; refused for an unbounded one (euclidean)."""
    from topoclip.geometry import get_topology

    topology = get_topology(model.topology)
    if not math.isfinite(topology.half_range(model.sphere_count)):
        low, high = topology.similarity_range(model.sphere_count)
        raise ConfigError(f"logit_range_like needs a bounded similarity; {model.topology} has the range ({low}, {high})")
    return topology.half_range(model.sphere_count)


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
         probe_size: int = 1000, cells: Optional[Sequence[str]] = None, first_seed: int = 0) -> list[RunSpec]:
    """Every (cell, seed) run of the grid (or of the cells matching `cells`) with its resolved config; the seeds
    are first_seed, ..., first_seed + seeds − 1 (more seeds of a finished grid, in a folder of their own).

    Refuses a run folder that was made with other settings.
    """
    out_dir = Path(out_dir)
    specs = []
    for levels in select_cells(grid, cells):
        columns = {lv.axis: lv.label for lv, axis in zip(levels, grid.axes) if axis.show}
        for seed in range(first_seed, first_seed + seeds):
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
    saved_path = RunFolder(spec.run_dir).config
    if not saved_path.is_file():
        return
    differences = sorted(config_differences(saved_settings(saved_path), spec.config))
    if differences:
        raise ConfigError(f"{spec.run_dir} was made with other settings ({', '.join(differences[:3])}"
                          f"{', …' if len(differences) > 3 else ''} differ); use another --out, or delete that folder")


def saved_settings(path: Path) -> dict:
    """A run's saved config.json as a dict of every setting: one written before a setting existed reads with
    that setting's default (which is what the run trained with), so it still equals a config made today."""
    values = json.loads(Path(path).read_text())
    try:
        return json.loads(json.dumps(to_dict(from_dict(Config, values))))
    except (ConfigError, TypeError, ValueError):
        return values  # unreadable as a config: compared as written (and found different)


def config_differences(saved, wanted, prefix: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(wanted, dict):
        keys = (set(saved) | set(wanted)) - (LABEL_KEYS if not prefix else set())
        return [d for key in keys for d in config_differences(saved.get(key), wanted.get(key), f"{prefix}{key}.")]
    return [] if saved == wanted else [prefix.rstrip(".")]
