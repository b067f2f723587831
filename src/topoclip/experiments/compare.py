"""`topoclip compare`: the default multi-token model against its sphere baseline, same recipe, N seeds.

A two-cell ablation (grid ``compare``: cpu-multi and cpu-sphere; under --preset P, P against the one-token sphere
of its whole dimension, `compare_grid`), so it is resumable the same way
(finished runs are skipped, killed ones resumed). For every headline metric of the final evaluation
(zero-shot top-1 of each built-in set in "distance" mode, retrieval mean recall) and for the final τ,
it reports mean ± sample std over the seeds of each model, the difference multi − sphere (of the
unrounded means) with its 95 % confidence interval and Welch's t p-value (`experiments.statistics`).

Writes OUT/compare.md, OUT/compare.json and OUT/compare.png (one bar pair per metric, error bars
= std), besides the ablation's own table.md / ablation.json / temperature.png.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable, Optional, Sequence

from topoclip.analysis.output import pyplot, save_figure, write_json
from topoclip.config import ConfigError
from topoclip.experiments.grid import Grid
from topoclip.experiments.report import stopped_reason
from topoclip.experiments.runner import ablate
from topoclip.experiments.statistics import mean_std, welch

GRID = "compare"
MODELS = ("multi", "sphere")
FIXED = ("model.topology", "model.class_tokens", "model.spheres", "model.embed_dim")  # what the models are


def metric_values(records: Sequence[dict]) -> dict[str, dict[str, list[float]]]:
    """{metric: {model label: [value per seed]}} from the ablation's run records (distance mode, final τ)."""
    table: dict[str, dict[str, list[float]]] = {}
    for record in records:
        numbers = {key.replace("/distance/top1", " top-1").replace("/mean_recall", " mean recall"): value
                   for key, value in record["headline"].items() if "/embedding/" not in key}
        numbers["final τ"] = math.exp(record["final_t"])
        for metric, value in numbers.items():
            table.setdefault(metric, {}).setdefault(record["label"], []).append(value)
    return table


def comparison_rows(values: dict[str, dict[str, list[float]]]) -> list[dict]:
    """Per metric: mean ± std of each model, and Welch's t for multi − sphere (effect, 95 % CI, p)."""
    rows = []
    for metric, per_model in values.items():
        row = {"metric": metric}
        for model in MODELS:
            mean, std = mean_std(per_model[model])
            row[model] = {"mean": mean, "std": std, "values": per_model[model]}
        row["difference"] = welch(per_model["multi"], per_model["sphere"]).as_dict()
        rows.append(row)
    return rows


# The default run's two models, as the tables of results written before each run's model was recorded name them.
DEFAULT_MODELS = {"multi": "Multi(16, 8), ps-inner", "sphere": "1 token, cosine"}


def markdown(rows: Sequence[dict], seeds: int, steps: int, models: Optional[dict] = None) -> str:
    """The comparison as a markdown table (numbers in %, τ as is); models: each label's model, as its runs describe it."""
    models = models or DEFAULT_MODELS
    lines = [f"Mean ± sample std over n = {seeds} seeds per model (train.seed 0 … {seeds - 1}), {steps} steps each; "
             "difference = multi − sphere (of the unrounded means) with its 95 % confidence interval and the "
             "two-sided p-value of Welch's t.", "",
             f"| metric | multi ({models['multi']}) | sphere ({models['sphere']}) | difference (95 % CI) | p |",
             "|---|---|---|---|---|"]
    for row in rows:
        def cell(model: str) -> str:
            return f"{row[model]['mean']:.1f} ± {row[model]['std']:.1f}"

        d = row["difference"]
        p = "< 0.001" if d["p"] < 0.001 else f"{d['p']:.3f}"
        lines.append(f"| {row['metric']} | {cell('multi')} | {cell('sphere')} | {d['effect']:+.1f} "
                     f"({d['low']:+.1f} to {d['high']:+.1f}) | {p} |")
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict], out_dir: Path, models: dict[str, str]) -> Path:
    """OUT/compare.png: a bar pair per metric with std error bars (τ left out: another scale), labelled with each
    label's model."""
    plt = pyplot()
    shown = [r for r in rows if r["metric"] != "final τ"]
    figure, axes = plt.subplots(figsize=(max(6.0, 0.9 * len(shown)), 4.0))
    width = 0.4
    for offset, model in zip((-width / 2, width / 2), MODELS):
        axes.bar([i + offset for i in range(len(shown))], [r[model]["mean"] for r in shown], width,
                 yerr=[r[model]["std"] for r in shown], capsize=3, label=f"{model}: {models[model]}")
    axes.set_xticks(range(len(shown)), [r["metric"] for r in shown], rotation=35, ha="right", fontsize=8)
    axes.set_ylabel("%")
    axes.set_title("a product of spheres against the sphere (mean ± std over seeds)")
    axes.legend()
    return save_figure(figure, out_dir, "compare")


def compare_grid(seeds: int, overrides: Sequence[str], preset: Optional[str]) -> tuple[Grid, dict[str, str]]:
    """The two-cell grid `compare` trains and each label's model (describe_model, topology): compare.json's (cpu-multi
    against cpu-sphere) or, under --preset P, P's own product of spheres against the one-token sphere of its whole
    dimension (P with model.topology=sphere, model.class_tokens=1, model.spheres=0, model.embed_dim=m·n). Refused in
    one line before any run where the comparison cannot be made: fewer than two seeds (Welch's t needs two a side),
    --set of what tells the models apart, a preset that is no product of spheres."""
    from topoclip.config import load_config
    from topoclip.core.geometry import get_topology
    from topoclip.experiments.grid import Axis, Level, cell_config, load_grid
    from topoclip.model.clip import describe_model

    if seeds < 2:
        raise ConfigError(f"compare needs at least 2 seeds per model (Welch's t compares their spreads); got {seeds}")
    fixed = [setting for setting in overrides if setting.split("=", 1)[0].strip() in FIXED]
    if fixed:
        raise ConfigError(f"compare's two models are its own (a product of spheres against the one-token sphere), so "
                          f"--set {fixed[0]:.60} would change both or blur them; compare other models with "
                          f"`topoclip ablate` and a grid")
    grid = load_grid(GRID)
    if preset is not None:
        model = load_config(preset, list(overrides)).model
        topology = get_topology(model.topology)
        if not (topology.product and not topology.curved and model.sphere_count > 1):
            raise ConfigError(f"compare trains a product of spheres against the one-token sphere; --preset {preset} is "
                              f"{describe_model(model)}: give a product-sphere preset (e.g. cpu-multi, tiny)")
        sphere = ["model.topology=sphere", "model.class_tokens=1", "model.spheres=0",
                  f"model.embed_dim={model.class_tokens * model.embed_dim}"]
        axis = Axis("model", [Level("model", "multi", preset), Level("model", "sphere", preset, sphere)], show=False)
        grid = dataclasses.replace(grid, preset=preset, axes=[axis])
    models = {}
    for level in grid.axes[0].levels:
        model = cell_config(grid, [level], overrides, 0).model
        models[level.label] = f"{describe_model(model)}, {model.topology}"
    return grid, models


def compare(out_dir, seeds: int = 3, steps: Optional[int] = None, overrides: Sequence[str] = (), jobs: int = 1,
            preset: Optional[str] = None, command: Optional[str] = None, log: Callable[[str], None] = print) -> dict:
    """Train (or finish) both models for `seeds` seeds; write compare.md / .json / .png; returns the JSON."""
    out_dir = Path(out_dir)
    grid, models = compare_grid(seeds, overrides, preset)
    result = ablate(grid, out_dir, seeds=seeds, steps=steps, overrides=overrides, jobs=jobs, probe_size=0,
                    command=command, log=log)
    if result["stopped"]:  # the comparison is of every seed of both models, or of none
        run = result["stopped"][0]
        raise ConfigError(f"compare: {run['cell']} seed {run['seed']} stopped on non-finite values "
                          f"({stopped_reason(run['stopped'])}), so the models cannot be compared over {seeds} seeds "
                          f"each; lower train.lr (--set) and use another --out")
    rows = comparison_rows(metric_values(result["runs"]))
    table = markdown(rows, seeds, result["steps"], models)
    (out_dir / "compare.md").write_text(table)
    picture = plot(rows, out_dir, models)
    summary = {"analysis": "compare", "command": result["command"], "seeds": list(range(seeds)),
               "steps": result["steps"], "machine": result["machine"], "wall_seconds": result["wall_seconds"],
               "models": models, "rows": rows, "table": table, "plots": [picture.name]}
    write_json(out_dir, "compare", summary)
    log(table)
    log(f"wrote {out_dir / 'compare.md'}, {out_dir / 'compare.json'}, {picture}")
    return summary
