"""The headline: Multi − sphere against steps, lr and noise on both tasks (its points, its table, its figure, and
the fingerprint that says which points a drawn figure shows)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

from topoclip.core.door import IMAGE_BYTES, is_regular, open_regular
from topoclip.experiments.statistics import welch
import topoclip.experiments.results.files as files
from topoclip.experiments.results.files import load_result
from topoclip.experiments.results.tables import pooled_values


# The full scenes' 2 × 2 trains each family at the lr its grid chose, as its preset carries it.
EACH_FAMILYS_LR = "each family's"


# The headline figure: Multi(16, 8) − Sphere(128), each at its default initial range, one point per (task, lr,
# caption noise, steps) that grids ran with both under one recipe and three or more seeds (where several grids
# share the runs, the one that trained them): (task, lr, caption noise %, grid, Multi's cell, the sphere's cell).
# The steps are the grid's; a tuple of grids pools the seeds of one recipe trained in several (`ablate --first-seed`).
# A grid that is not in docs/results yet (the full scenes' runs under way) is left out.
HEADLINE = (
    *(("built-in", 2e-3, 0, grid, "multi-default-t", "sphere-default-t") for grid in ("tau-range", "tau-range-4800", "tau-range-9600")),
    ("built-in", 1e-3, 0, "tau-range-lr1e-3-4800", "multi-default-t", "sphere-default-t"),
    ("built-in", 1e-3, 0, ("tau-range-lr1e-3-9600", "tau-range-lr1e-3-9600-more"), "multi-default-t", "sphere-default-t"),
    ("built-in", 1e-3, 0, "noise-lr1e-3-19200", "multi_0", "sphere_0"),
    *(("built-in", 1e-3, noise, grid, f"multi_{noise}", f"sphere_{noise}") for noise in (15, 30, 50)
      for grid in ("noise-4800", "noise-lr1e-3-9600", "noise-lr1e-3-19200") if (noise, grid) != (15, "noise-lr1e-3-19200")),
    *(("full scenes", lr, 0, grid, f"multi_lr-{name}", f"sphere_lr-{name}") for lr, name in ((5e-4, "5e-4"), (1e-3, "1e-3"), (2e-3, "2e-3"))
      for grid in ("hard-lr-9600",)),
    *(("full scenes", EACH_FAMILYS_LR, 0, grid, "multi-default-t", "sphere-default-t")
      for grid in ("tau-range-full-scenes-9600", "tau-range-full-scenes-19200")),
)


HEADLINE_METRICS = {"in-domain": "headline:scenes-test/mean_recall", "out-of-domain": "headline:scenes-test-ood/mean_recall"}


def lr_name(lr: float | str) -> str:
    """2e-3 for 0.002, as the grids' cells spell an lr; EACH_FAMILYS_LR as the full-scenes presets set it."""
    if lr == EACH_FAMILYS_LR:
        from topoclip.config.loading import load_config

        return ", ".join(f"{lr_name(load_config(f'cpu-{family}-full-scenes').train.lr)} {family}" for family in ("multi", "sphere"))
    return format(lr, ".0e").replace("e-0", "e-")


def headline_points() -> list[dict]:
    """Each point of the headline figure: its recipe, its steps, and Welch's t of Multi − sphere on each metric of
    HEADLINE_METRICS (points whose grid is not in docs/results, or whose cells have fewer than two seeds, left out)."""
    points = []
    for task, lr, noise, grids, multi, sphere in HEADLINE:
        grids = (grids,) if isinstance(grids, str) else grids
        if not all(files.results_file(files.RESULTS / grid, "ablation.json").is_file() for grid in grids):
            continue
        if not all({multi, sphere} <= {r["cell"] for r in load_result(grid)["runs"]} for grid in grids):
            continue
        differences = {name: welch(pooled_values([[grid, multi] for grid in grids], metric),
                                   pooled_values([[grid, sphere] for grid in grids], metric))
                       for name, metric in HEADLINE_METRICS.items()}
        if min(d.n_a for d in differences.values()) < 2 or min(d.n_b for d in differences.values()) < 2:
            continue
        points.append({"task": task, "lr": lr, "noise": noise, "steps": load_result(grids[0])["steps"], "grids": grids,
                       "cells": [multi, sphere],
                       **{name: d.as_dict() for name, d in differences.items()}})
    return points


def headline_table(points: list[dict]) -> str:
    lines = ["| task | lr | caption noise | steps | n (Multi, sphere) | " + " | ".join(f"{name} mean recall, Multi − sphere"
             for name in HEADLINE_METRICS) + " | grids |", "|---|---|---|---|---|" + "---|" * len(HEADLINE_METRICS) + "---|"]
    for point in points:
        cells = []
        for name in HEADLINE_METRICS:
            d = point[name]
            bold = "**" if d["low"] > 0 or d["high"] < 0 else ""
            cells.append(f"{bold}{d['effect']:+.1f}{bold} ({d['low']:+.1f} to {d['high']:+.1f})")
        n = point["in-domain"]
        lines.append(f"| {point['task']} | {lr_name(point['lr'])} | {point['noise']} % | {point['steps']:,} | {n['n_a']}, {n['n_b']} | "
                     + " | ".join(cells) + " | " + ", ".join(f"[{grid}]({grid}/{files.results_file(files.RESULTS / grid, 'ablation.json').name})"
                                   for grid in point["grids"]) + " |")
    return "\n".join(lines + ["", "Each cell: the difference of the seed means and its 95 % interval (Welch's t); bold where "
                                   "the interval excludes 0. Where a row names two grids, the second added seeds of the same "
                                   "recipe after the first's results were known." + reused_runs(points) + " Drawn in headline.png."])


def reused_runs(points: list[dict]) -> str:
    """" N of the M runs of GRID's row are SOURCE's (…)": a row's runs that are copies (`ablate --reuse`) of another
    grid's, which are then not new evidence beside that grid (e.g. the runs that chose an lr)."""
    said = []
    for point in points:
        for grid in point["grids"]:
            runs = [r for r in load_result(grid)["runs"] if r["cell"] in point["cells"]]
            # reused_from is relative to the grid's folder or to its run's: the grid copied is the first named part
            sources = [next(part for part in Path(os.path.normpath(f"{grid}/{r['reused_from']}")).parts if part != "..")
                       for r in runs if r.get("reused_from")]
            said += [f" {sources.count(source)} of the {len(runs)} runs of {grid}'s row are {source}'s (the same recipe "
                     f"and seed, copied with `ablate --reuse`)." for source in dict.fromkeys(sources)]
    return "".join(said)


FINGERPRINT_KEY = "topoclip-points-sha256"  # the PNG text chunk that holds it


def fingerprint(points: list[dict]) -> str:
    """sha256 of the headline figure's points, each float to 6 significant digits (far finer than the figure draws; a
    last-bit difference of another libm changes it only at a rounding boundary, about once in 1e10): stored in
    headline.png, so `check` knows a figure drawn from other results."""
    def rounded(value):
        if isinstance(value, float):
            return float(f"{value:.6g}")
        if isinstance(value, dict):
            return {key: rounded(item) for key, item in value.items()}
        return [rounded(item) for item in value] if isinstance(value, (list, tuple)) else value

    return hashlib.sha256(json.dumps(rounded(points), sort_keys=True).encode()).hexdigest()


def drawn_from(path: Path) -> Optional[str]:
    """The fingerprint of the points a headline.png was drawn from (None: none stored, or no figure)."""
    from PIL import Image

    if not is_regular(path):
        return None
    with open_regular(path, "headline figure", limit=IMAGE_BYTES, error=ValueError) as file, Image.open(file) as image:
        return image.text.get(FINGERPRINT_KEY)


def plot_headline(points: list[dict], path: Path) -> Path:
    """headline.png: Multi − sphere (95 % interval) against the steps, one panel per task and metric, one line per
    lr and caption noise."""
    from topoclip.analysis.output import pyplot

    plt = pyplot()
    tasks = list(dict.fromkeys(task for task, *_ in HEADLINE))  # every task, a panel of one with no grid yet says so
    figure, axes = plt.subplots(len(HEADLINE_METRICS), len(tasks), figsize=(6.0 * len(tasks), 3.6 * len(HEADLINE_METRICS)),
                                squeeze=False)
    ticks = sorted({p["steps"] for p in points}) or [9600]
    recipes = list(dict.fromkeys((p["lr"], p["noise"]) for p in points))  # one colour per recipe, in every panel
    for column, task in enumerate(tasks):
        series = list(dict.fromkeys((p["lr"], p["noise"]) for p in points if p["task"] == task))
        for row, name in enumerate(HEADLINE_METRICS):
            axis = axes[row][column]
            axis.axhline(0, color="black", linewidth=0.8)
            for index, (lr, noise) in enumerate(series):
                mine = sorted((p for p in points if p["task"] == task and (p["lr"], p["noise"]) == (lr, noise)),
                              key=lambda p: p["steps"])
                offset = 1 + 0.04 * (index - (len(series) - 1) / 2)  # side by side on the log axis
                steps = [p["steps"] * offset for p in mine]
                effect = [p[name]["effect"] for p in mine]
                errors = [[p[name]["effect"] - p[name]["low"] for p in mine], [p[name]["high"] - p[name]["effect"] for p in mine]]
                axis.errorbar(steps, effect, yerr=errors, marker="o", capsize=3, linewidth=1.2,
                              color=f"C{recipes.index((lr, noise)) % 10}",
                              label=f"lr {lr_name(lr)}" + (f", {noise} % noise" if noise else ""))
            if not series:
                axis.text(0.5, 0.5, "no finished grid yet\n(pre-registered, runs under way)", ha="center", va="center",
                          transform=axis.transAxes, fontsize=9, color="grey")
            axis.set_xscale("log", base=2)
            axis.set_xlim(ticks[0] / 1.3, ticks[-1] * 1.3)
            axis.set_xticks(ticks, [f"{step:,}" for step in ticks])
            axis.minorticks_off()
            axis.set_title(f"{task}: {name} mean recall", fontsize=10)
            axis.set_ylabel("Multi − sphere (points)")
            axis.grid(alpha=0.3)
            axis.set_xlabel("steps")
        if series:
            axes[0][column].legend(fontsize=7)
    figure.suptitle("Multi(16, 8) − Sphere(128), each at its default initial range: difference of the seed means, "
                    "95 % interval (Welch's t)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110, metadata={FINGERPRINT_KEY: fingerprint(points)})
    plt.close(figure)
    return path
