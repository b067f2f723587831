"""`topoclip compare`: the default multi-token model against its sphere baseline, same recipe, N seeds.

A two-cell ablation (grid ``compare``: cpu-multi and cpu-sphere), so it is resumable the same way
(finished runs are skipped, killed ones resumed). For every headline metric of the final evaluation
(zero-shot top-1 of each built-in set in "distance" mode, retrieval mean recall) and for the final τ,
it reports mean ± sample std over the seeds of each model, the difference multi − sphere (of the
unrounded means) with its 95 % confidence interval and Welch's t p-value (`experiments.statistics`).

Writes OUT/compare.md, OUT/compare.json and OUT/compare.png (one bar pair per metric, error bars
= std), besides the ablation's own table.md / ablation.json / temperature.png.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Optional, Sequence

from topoclip.analysis.output import pyplot, save_figure, write_json
from topoclip.experiments.runner import ablate
from topoclip.experiments.statistics import mean_std, welch

GRID = "compare"
MODELS = ("multi", "sphere")
FIXED = ("model.topology", "model.class_tokens")  # what tells the two models apart


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


def plot(rows: Sequence[dict], out_dir: Path) -> Path:
    """OUT/compare.png: a bar pair per metric with std error bars (τ left out: another scale)."""
    plt = pyplot()
    shown = [r for r in rows if r["metric"] != "final τ"]
    figure, axes = plt.subplots(figsize=(max(6.0, 0.9 * len(shown)), 4.0))
    width = 0.4
    for offset, model in zip((-width / 2, width / 2), MODELS):
        axes.bar([i + offset for i in range(len(shown))], [r[model]["mean"] for r in shown], width,
                 yerr=[r[model]["std"] for r in shown], capsize=3, label=model)
    axes.set_xticks(range(len(shown)), [r["metric"] for r in shown], rotation=35, ha="right", fontsize=8)
    axes.set_ylabel("%")
    axes.set_title("multi-token product sphere vs sphere baseline (mean ± std over seeds)")
    axes.legend()
    return save_figure(figure, out_dir, "compare")


def compared_models(seeds: int, overrides: Sequence[str], preset: Optional[str]) -> dict[str, str]:
    """Each label's model (describe_model, topology), refused in one line before any run when the comparison cannot
    be made: fewer than two seeds (Welch's t needs two a side), or settings under which both models are the same."""
    from topoclip.config import ConfigError
    from topoclip.experiments.grid import cell_config, load_grid
    from topoclip.model.clip import describe_model

    if seeds < 2:
        raise ConfigError(f"compare needs at least 2 seeds per model (Welch's t compares their spreads); got {seeds}")
    fixed = [setting for setting in overrides if setting.split("=", 1)[0].strip() in FIXED]
    if fixed:
        raise ConfigError(f"compare's two models are its own (the multi-token product sphere against the one-token "
                          f"sphere), so --set {fixed[0]:.60} would change both or blur them; compare other models with "
                          f"`topoclip ablate` and a grid")
    grid = load_grid(GRID)
    configs = {level.label: cell_config(grid, [level], overrides, 0, preset).model for level in grid.axes[0].levels}
    if configs["multi"] == configs["sphere"]:
        raise ConfigError(f"compare: under --preset {preset} both models are {describe_model(configs['multi'])}; it "
                          f"trains the multi-token model against the one-token sphere: give a multi-token preset")
    return {label: f"{describe_model(model)}, {model.topology}" for label, model in configs.items()}


def compare(out_dir, seeds: int = 3, steps: Optional[int] = None, overrides: Sequence[str] = (), jobs: int = 1,
            preset: Optional[str] = None, command: Optional[str] = None, log: Callable[[str], None] = print) -> dict:
    """Train (or finish) both models for `seeds` seeds; write compare.md / .json / .png; returns the JSON."""
    out_dir = Path(out_dir)
    models = compared_models(seeds, overrides, preset)
    result = ablate(GRID, out_dir, seeds=seeds, steps=steps, overrides=overrides, jobs=jobs, preset=preset,
                    probe_size=0, command=command, log=log)
    rows = comparison_rows(metric_values(result["runs"]))
    table = markdown(rows, seeds, result["steps"], models)
    (out_dir / "compare.md").write_text(table)
    picture = plot(rows, out_dir)
    summary = {"analysis": "compare", "command": result["command"], "seeds": list(range(seeds)),
               "steps": result["steps"], "machine": result["machine"], "wall_seconds": result["wall_seconds"],
               "models": models, "rows": rows, "table": table, "plots": [picture.name]}
    write_json(out_dir, "compare", summary)
    log(table)
    log(f"wrote {out_dir / 'compare.md'}, {out_dir / 'compare.json'}, {picture}")
    return summary
