"""The report of an ablation: Table 6's columns per cell (mean ± sample std over seeds, the paper's row beside
ours), the late-rise test of each cell's validation curve, and the plots (curves.png, temperature.png)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Callable, Optional, Sequence

from topoclip.analysis.output import write_json
from topoclip.analysis.temperature import TOLERANCE, plot_curves, read_curve
from topoclip.experiments.grid import Grid
from topoclip.experiments.statistics import mean_std, paired

PROBE_TASK = "shape"  # the built-in set of the linear-probe column


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
    """Paired t of `key` at the runs' last periodic evaluation before the last step against the one nearest
    LATE_FRACTION of the run before it; None unless ≥ 2 runs have both. The validation at the last step itself is left
    out: runs trained before the trainer validated there have none, and a cell mixing both (`--reuse`) would else
    compare its seeds over different steps."""
    logged = [{e["step"]: e[key] for e in run.get("evaluations", []) if key in e and (not steps or e["step"] < steps)}
              for run in runs]
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


def stopped_reason(reason: str) -> str:
    """The trainer's reason a run stopped, as a table or a console line shows it: its first clause, one line, bounded
    (the file it comes from is in the ablation folder, anyone's)."""
    return " ".join(reason.split(";")[0].split())[:200]


def markdown_table(grid: Grid, rows: Sequence[dict], meta: dict) -> str:
    """Table 6's columns (plus the grid's shown axes) as a markdown document."""
    shown = [axis.name for axis in grid.axes if axis.show]
    header = (["model"] + shown + ["t init", "learnable", "final t", "convergence step", "I2T R@1", "T2I R@1",
              f"zero-shot top-1 ({grid.zero_shot_set})", "still rising?", f"linear probe ({PROBE_TASK})"])
    lines = [f"# Ablation `{grid.name}`", "", grid.description, "",
             ("" if meta["cells"] == "all" else f"Reduced grid: the cells matching {' '.join(meta['cells'])}. ")
             + (f"{meta['reused']} of the {len(rows) * meta['seeds']} runs are copies of runs of other ablations made "
                f"with the same config (`--reuse`; `reused_from` in ablation.json). " if meta.get("reused") else "")
             + f"Mean ± sample std over n = {meta['seeds']} seed(s) (train.seed {meta.get('first_seed', 0)} … "
             f"{meta.get('first_seed', 0) + meta['seeds'] - 1}); base preset "
             f"`{meta['preset']}`; {meta['steps']} steps; command `{meta['command']}`. "
             f"Retrieval: built-in scenes test split (in-domain), R@1 in %; zero-shot: the `{grid.zero_shot_set}` set, "
             f"distance mode; linear probe: L-BFGS logistic regression on the frozen class-token features "
             f"(`topoclip analyze probe`). Convergence step: first logged step after which τ stays within "
             f"{TOLERANCE:.0%} of its value for a window W (one epoch, at most a quarter of the run; "
             f"`topoclip analyze temperature`), averaged over the seeds that converged ((k/n) when not all did). "
             f"Still rising?: the zero-shot top-1 of the periodic validation evaluations at the last one against "
             f"the one {LATE_FRACTION:.0%} of the run before (paired t over the seeds): \"yes\" when its 95 % "
             f"interval, shown, is above 0; \"—\" without periodic evaluations."
             + (f" Rows in italics are the paper's, from its {grid.paper['source']}" if grid.paper else "")
             + "".join(f" Left out: {run['cell']} seed {run['seed']}, which stopped on non-finite values "
                       f"({stopped_reason(run['stopped'])})." for run in meta.get("stopped", [])), "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    # Rows that the model, the shown axes and τ's start do not tell apart (a hidden axis that changes training, as the
    # lorentz grid's entailment loss) are named by their cell too.
    def seen(row: dict) -> tuple:
        return row["model"], *(row["columns"][name] for name in shown), row["t_init"], row["learnable"]

    same = Counter(map(seen, rows))
    for row in rows:
        def column(key: str, digits: int) -> str:
            return _format(row[key]["values"], digits)

        convergence = column("convergence_step", 0) if row["learnable"] else "fixed"
        model = row["model"] + (f" (`{row['cell']}`)" if same[seen(row)] > 1 else "")
        cells = ([model] + [row["columns"][name] for name in shown]
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
    if rise["low"] == rise["high"]:  # every seed moved by the same amount: no spread to test against (`unvaried`)
        return f"{'yes' if rise['effect'] > 0 else 'no'} {rise['effect']:+.1f} (every seed the same)"
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


def plot_temperatures(records: Sequence[dict], out_dir) -> Optional[Path]:
    """OUT/temperature.png: every run's t, one colour per cell, one panel per model (as the paper's Fig. 4); None
    without a run (every run of the grid stopped on non-finite values)."""
    if not records:
        return None
    curves = [read_curve(Path(out_dir) / r["run_dir"]) for r in records]
    return plot_curves(curves, out_dir, "temperature", groups=[r["label"] for r in records],
                       panels=[r["model"] for r in records])


def write_report(grid: Grid, records: Sequence[dict], meta: dict, out_dir: Path, log: Callable[[str], None] = print) -> dict:
    """OUT/table.md, OUT/ablation.json and the plots from every run's record and how the grid was run (meta)."""
    rows = summary_rows(records, meta["steps"], grid.zero_shot_set)
    (out_dir / "table.md").write_text(markdown_table(grid, rows, meta))
    plots = [plot for plot in (plot_temperatures(records, out_dir), plot_evaluations(records, out_dir, grid.zero_shot_set))
             if plot]
    result = {"analysis": "ablation", **meta, "description": grid.description, "rows": rows, "runs": list(records),
              "plots": [plot.name for plot in plots], "table": "table.md"}
    write_json(out_dir, "ablation", result)
    log(f"wrote {out_dir / 'table.md'}, {out_dir / 'ablation.json'}, {', '.join(map(str, plots))}")
    return result
