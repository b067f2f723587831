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
from topoclip.io.run_folder import RunFolder

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
    file: Optional[Path] = None  # the grid file it was read from (None: shipped); its settings are data, never commands

    def cells(self) -> list[tuple[Level, ...]]:
        """Every combination of one level per axis, in the order the axes list them."""
        return list(itertools.product(*(axis.levels for axis in self.axes)))

    def cell_count(self) -> int:
        return math.prod(len(axis.levels) for axis in self.axes)


# Bounds on what a grid file and the command line may ask for, checked before anything is planned: the largest
# shipped grid has 12 cells and 3 seeds; a grid of 8 axes × 20 levels would be 2.6e10 cells.
MAX_CELLS = 10_000
MAX_RUNS = 100_000  # cells × seeds


def grid_names() -> list[str]:
    """The grids shipped with topoclip."""
    return sorted(Path(p.name).stem for p in resources.files(GRIDS_PACKAGE).iterdir() if p.name.endswith(".json"))


def _text_list(value, where: str) -> list[str]:
    """A list of --set strings; a bare string would be read character by character."""
    if isinstance(value, str):
        raise ConfigError(f"{where} is the string {value!r:.80}; give a list of settings, e.g. [{json.dumps(value)[:80]}]")
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ConfigError(f"{where} must be a list of settings (strings such as \"train.steps=100\"), not {json.dumps(value)[:80]}")
    return list(value)


def load_grid(name: str) -> Grid:
    """A shipped grid by name, or a grid JSON file (read through the door; its shape checked before anything is
    planned from it)."""
    from topoclip.core.door import read_json

    shipped = {Path(p.name).stem: p for p in resources.files(GRIDS_PACKAGE).iterdir() if p.name.endswith(".json")}
    if name in shipped:
        values, grid_name, file = json.loads(shipped[name].read_text()), name, None
    elif Path(name).exists():
        values, grid_name, file = read_json(Path(name), "grid file", expect=dict, error=ConfigError), Path(name).stem, Path(name)
    else:
        raise ConfigError(f"unknown grid {name!r:.200}; choose one of {grid_names()} or give a grid JSON file")
    where = f"grid {name!r:.200}"

    def text(value, key: str, optional: bool = False) -> Optional[str]:
        if value is None and optional:
            return None
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}: {key} must be text, not {json.dumps(value)[:80]}; see topoclip.experiments.grid")
        return value

    def mapping(value, key: str) -> dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {key} must be a JSON object, not {json.dumps(value)[:80]}; see topoclip.experiments.grid")
        return value

    def levels_of(axis: dict, index: int) -> list[Level]:
        levels = axis.get("levels")
        if not isinstance(levels, list) or not levels:
            raise ConfigError(f"{where}: axis {index} needs a list of levels; see topoclip.experiments.grid")
        return [Level(axis["name"], text(level.get("label"), f"axis {index} level {k}'s label"),
                      text(level.get("preset"), f"axis {index} level {k}'s preset", optional=True),
                      _text_list(level.get("set", []), f"{where}: axis {index} level {k}'s \"set\""),
                      text(level.get("logit_range_like"), f"axis {index} level {k}'s logit_range_like", optional=True))
                for k, level in enumerate(mapping(level, f"axis {index} level {k}") for k, level in enumerate(levels))]

    axes_values = values.get("axes")
    if not isinstance(axes_values, list) or not axes_values:
        raise ConfigError(f"{where} is malformed: it needs a list of axes; see topoclip.experiments.grid")
    axes = []
    for index, axis in enumerate(mapping(axis, f"axis {index}") for index, axis in enumerate(axes_values)):
        text(axis.get("name"), f"axis {index}'s name")
        show = axis.get("show", True)
        if not isinstance(show, bool):
            raise ConfigError(f"{where}: axis {index}'s \"show\" must be true or false")
        axes.append(Axis(axis["name"], levels_of(axis, index), show))
        slugs = [slug(level.label) for level in axes[-1].levels]
        twice = next((label for label in slugs if slugs.count(label) > 1), None)
        if twice:  # one run folder for two cells: one would be trained, and reported as both
            shown = [level.label for level in axes[-1].levels if slug(level.label) == twice]
            raise ConfigError(f"{where}: axis {index}'s levels {shown[0]!r:.40} and {shown[1]!r:.40} name the same cell "
                              f"folder ({twice!r:.40}); give them labels that differ in letters or digits")
        if math.prod(len(a.levels) for a in axes) > MAX_CELLS:
            raise ConfigError(f"{where} has more than {MAX_CELLS:,} cells (the product of its axes' levels); split it "
                              f"into smaller grids")
    description = values.get("description", "")
    if not isinstance(description, str):
        raise ConfigError(f"{where}: its description must be text")
    grid = Grid(grid_name, description, text(values.get("preset"), "preset"),
                _text_list(values.get("settings", []), f"{where}: its \"settings\""), axes,
                text(values.get("zero_shot_set", "shape"), "zero_shot_set"), mapping(values.get("paper", {}), "paper"),
                file)
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
    from topoclip.core.geometry import get_topology

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
        # The grid file's settings are data: only the user's own (`overrides`) may turn on a command or the network.
        return load_config(base, settings + [f"train.seed={seed}"], values={"name": name}, typed=list(overrides),
                           files=[grid.file] if grid.file else [])

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
    from topoclip.core.door import check_inside

    out_dir = Path(out_dir)
    chosen = select_cells(grid, cells)
    if len(chosen) * seeds > MAX_RUNS:
        raise ConfigError(f"{len(chosen):,} cells × {seeds:,} seeds is {len(chosen) * seeds:,} runs, over the "
                          f"{MAX_RUNS:,} one ablation may plan; ask for fewer seeds or cells (--seeds, --cells)")
    specs = []
    for levels in chosen:
        columns = {lv.axis: lv.label for lv, axis in zip(levels, grid.axes) if axis.show}
        for seed in range(first_seed, first_seed + seeds):
            config = cell_config(grid, levels, overrides, seed, preset)
            run_dir = out_dir / RUNS / cell_name(levels) / f"seed-{seed}"
            log_file = out_dir / "logs" / f"{cell_name(levels)}-seed-{seed}.log"
            for path in (run_dir, log_file):  # every folder on the way: a planted runs/CELL -> ~/data is refused
                check_inside(path, out_dir, "ablation folder", ConfigError)
            spec = RunSpec(cell_name(levels), cell_label(levels), columns, seed, str(run_dir), str(log_file),
                           json.loads(json.dumps(to_dict(config))), probe_size, grid.zero_shot_set)
            check_existing(spec)
            specs.append(spec)
    return specs


def out_folder(spec: RunSpec) -> Path:
    """The ablation folder OUT of a run OUT/runs/CELL/seed-K."""
    return Path(spec.run_dir).parents[2]


def check_existing(spec: RunSpec) -> None:
    """A run folder with a config.json must have been made with exactly this config."""
    saved_path = RunFolder(spec.run_dir).config
    if not saved_path.exists():
        return
    differences = sorted(config_differences(saved_settings(saved_path, out_folder(spec)), spec.config))
    if differences:
        raise ConfigError(f"{spec.run_dir} was made with other settings ({', '.join(differences[:3])}"
                          f"{', …' if len(differences) > 3 else ''} differ); use another --out, or delete that folder")


def saved_settings(path: Path, root: Optional[Path] = None) -> dict:
    """A run's saved config.json as a dict of every setting: one written before a setting existed reads with
    that setting's default (which is what the run trained with), so it still equals a config made today. Read
    through the door (inside `root`, the folder it came in); ConfigError when it is not a JSON object."""
    from topoclip.core.door import read_json

    values = read_json(path, "a run's config", root, expect=dict, error=ConfigError)
    try:
        return json.loads(json.dumps(to_dict(from_dict(Config, values))))
    except (ConfigError, TypeError, ValueError):
        return values  # unreadable as a config: compared as written (and found different)


def config_differences(saved, wanted, prefix: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(wanted, dict):
        keys = (set(saved) | set(wanted)) - (LABEL_KEYS if not prefix else set())
        return [d for key in keys for d in config_differences(saved.get(key), wanted.get(key), f"{prefix}{key}.")]
    return [] if saved == wanted else [prefix.rstrip(".")]
