"""τ and t over training, and the step where τ converges (paper Fig. 4; Table 6's "Temp. Final"
and "Converge Step").

Reads each run folder's metrics.jsonl (``scale`` = τ and ``t`` at every logged step) and config.json.

**Convergence step** — our reading of the paper's "changes less than 2 % for an epoch": the first
logged step s such that every τ logged in [s, s + W] is within 2 % of τ(s),

    max over logged s' in [s, s + W] of |τ(s') / τ(s) − 1| < 0.02,

where the window W is one epoch of the run's training data (built-in scenes: train_size /
batch_size steps; shards: samples_per_epoch / batch_size), capped at a quarter of the run so a
short run can still be judged; a quarter of the run when the epoch is unknown (CSV, endless
shards). Only windows that end inside the run count: a run still drifting at its end has no
convergence step (None). A fixed τ (model.temperature.learnable false) has none either; tables
show it as "fixed" (the paper's "Detach").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from topoclip.analysis.inputs import find_run_folder
from topoclip.data.sources import SourceError, epoch_steps
from topoclip.io.run_folder import RunFolder
from topoclip.analysis.output import pyplot, save_figure, write_json
from topoclip.io.checkpoint import load_config_from
from topoclip.config import Config

TOLERANCE = 0.02
TAU_TICKS = (0.5, 1, 2, 3, 5, 7, 10, 12, 15, 20, 30, 50, 70, 100, 150, 200, 300)  # right-hand axis of the t plots


def default_window(config: Config) -> int:
    """W in steps: one epoch, capped at a quarter of the run (a quarter of the run when no epoch is known)."""
    quarter = max(1, config.train.steps // 4)
    try:
        epoch = epoch_steps(config.data, config.train.batch_size)
    except SourceError:  # a table smaller than a batch: no whole epoch to speak of
        epoch = None
    return quarter if epoch is None else min(epoch, quarter)


def convergence_step(steps: Sequence[int], scales: Sequence[float], window: int,
                     tolerance: float = TOLERANCE) -> Optional[int]:
    """First logged step s with |τ(s') / τ(s) − 1| < tolerance for every logged s' in [s, s + window]; else None.

    steps: (K,) increasing logged steps; scales: (K,) τ at those steps.
    """
    steps_array = np.asarray(steps, dtype=np.int64)
    tau = np.asarray(scales, dtype=np.float64)
    if steps_array.size == 0:
        return None
    last = steps_array[-1]
    for i, start in enumerate(steps_array):
        if start + window > last:  # the window would run past the end of the run
            return None
        stop = np.searchsorted(steps_array, start + window, side="right")
        if np.all(np.abs(tau[i:stop] / tau[i] - 1.0) < tolerance):
            return int(start)
    return None


@dataclass
class TemperatureCurve:
    """One run's τ over training and what Table 6 reports about it."""

    name: str
    run_dir: Path
    steps: list[int]
    scale: list[float]  # τ
    t: list[float]  # log τ
    init_t: float
    learnable: bool
    max_scale: float
    window: int
    convergence_step: Optional[int] = None
    final_t: Optional[float] = None

    def summary(self) -> dict:
        """The JSON record of this run (curve included)."""
        return {"name": self.name, "run_dir": str(self.run_dir), "init_t": self.init_t, "learnable": self.learnable,
                "max_scale": self.max_scale, "final_t": self.final_t,
                "final_scale": self.scale[-1] if self.scale else None, "window": self.window,
                "tolerance": TOLERANCE, "convergence_step": self.convergence_step,
                "steps": self.steps, "scale": self.scale, "t": self.t}


def read_curve(path, window: Optional[int] = None, tolerance: float = TOLERANCE,
               name: Optional[str] = None) -> TemperatureCurve:
    """The τ curve of a run folder (or of the run a checkpoint belongs to)."""
    from topoclip.io.run_folder import read_metrics

    run_dir = find_run_folder(path)
    config = load_config_from(run_dir)
    logged = [r for r in read_metrics(RunFolder(run_dir).metrics) if "scale" in r and "t" in r]
    steps = [int(r["step"]) for r in logged]
    scales = [float(r["scale"]) for r in logged]
    t_values = [float(r["t"]) for r in logged]
    temperature = config.model.temperature
    width = window or default_window(config)
    converged = convergence_step(steps, scales, width, tolerance) if temperature.learnable else None
    return TemperatureCurve(name or run_dir.name, run_dir, steps, scales, t_values, temperature.init,
                            temperature.learnable, temperature.max_scale, width, converged,
                            t_values[-1] if t_values else None)


def plot_curves(curves: Sequence[TemperatureCurve], out_dir, name: str = "temperature",
                groups: Optional[Sequence[str]] = None, panels: Optional[Sequence[str]] = None) -> Path:
    """t against the step (τ = exp t on the right axis), every run overlaid; ● marks the convergence step.

    groups: one label per curve; curves sharing a label share a colour and a legend entry (e.g. the
    seeds of one ablation cell). panels: one title per curve; one panel per distinct title (e.g. one
    per topology, as the paper's Fig. 4); default one panel.
    """
    plt = pyplot()
    labels = list(groups) if groups is not None else [c.name for c in curves]
    titles = list(panels) if panels is not None else [""] * len(curves)
    panel_order = list(dict.fromkeys(titles))
    columns = min(len(panel_order), 4)
    rows = math.ceil(len(panel_order) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.6 * columns + 1.5, 3.6 * rows), squeeze=False, sharey=True)
    for index, title in enumerate(panel_order):
        axis = axes[index // columns][index % columns]
        members = [(c, label) for c, label, t in zip(curves, labels, titles) if t == title]
        order = list(dict.fromkeys(label for _, label in members))
        colours = plt.get_cmap("tab10" if len(order) <= 10 else "tab20")
        shown = set()
        for curve, label in members:
            colour = colours(order.index(label) % colours.N)
            axis.plot(curve.steps, curve.t, color=colour, linewidth=1.2, label=None if label in shown else label)
            shown.add(label)
            if curve.convergence_step is not None:
                at = curve.steps.index(curve.convergence_step)
                axis.plot([curve.steps[at]], [curve.t[at]], "o", color=colour, markersize=5)
        tau_axis = axis.secondary_yaxis("right", functions=(np.exp, lambda tau: np.log(np.clip(tau, 1e-12, None))))
        tau_axis.set_yticks(TAU_TICKS, [f"{tau:g}" for tau in TAU_TICKS])
        tau_axis.set_ylabel("τ")
        axis.set_title(title or "t = log τ (● = convergence step)", fontsize=9)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    for index in range(len(panel_order), rows * columns):
        axes[index // columns][index % columns].set_visible(False)
    for row in axes:
        row[0].set_ylabel("t (Table 6's Temp. columns)")
    figure.tight_layout()
    return save_figure(figure, out_dir, name)


def analyze_temperature(paths: Sequence, out_dir, window: Optional[int] = None,
                        tolerance: float = TOLERANCE) -> dict:
    """Read every run, write temperature.png and temperature.json; returns the JSON dict."""
    curves = [read_curve(path, window, tolerance) for path in paths]
    plot = plot_curves(curves, out_dir)
    result = {"analysis": "temperature", "tolerance": tolerance,
              "definition": "first logged step s with |τ(s')/τ(s) − 1| < tolerance for all logged s' in [s, s + window]",
              "runs": [curve.summary() for curve in curves], "plots": [plot.name]}
    write_json(out_dir, "temperature", result)
    return result
