"""The figures of README.md and docs/results/README.md, generated from committed results files.

    python scripts/readme_results.py record RUN_DIR --wall-seconds S   # docs/results/default-run.json from a run
    python scripts/readme_results.py write                             # rewrite the documents' blocks, draw headline.png
    python scripts/readme_results.py check                             # exit 1 when a document or headline.png disagrees
    python scripts/readme_results.py plot GRID OUT                     # OUT/curves.png of docs/results/GRID
    python scripts/readme_results.py land OUT [--pool POOL]            # docs/results/NAME/ablation.json of an ablate --out

The documents hold generated blocks between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->``.
The source of each is in docs/results/: NAME.json (``default-run``: `topoclip train`'s eval.json plus
how it was run; ``compare``: what `topoclip compare` wrote; ``claims``: the paper's claims, which
cells measure each, and our verdict; {"parts": [...]}: a grid trained in parts, `pooled`), or
NAME/ablation.json (what `topoclip ablate` wrote), or
NAME/*.json (``experts``, ``equilibrium``, ``similarities``: that `topoclip analyze` command on each run).
tests/test_readme_results.py runs `check`.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import os
import platform
import re
import shlex
import sys
from collections import Counter
from pathlib import Path
from typing import Optional

from topoclip.core.door import read_json
from topoclip.core.errors import file_name_problem
from topoclip.experiments.compare import MODELS, comparison_rows
from topoclip.experiments.compare import markdown as compare_markdown
from topoclip.experiments.grid import load_grid
from topoclip.experiments.report import markdown_table
from topoclip.experiments.statistics import (format_p, holm, mean_std, paired, permutation, prediction, tost,
                                             welch)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
README = ROOT / "README.md"
DOCUMENTS = (README, *sorted((ROOT / "docs").glob("*.md")), *sorted(RESULTS.glob("*.md")))  # the front door, the docs, the report


def default_run_table(results: dict) -> str:
    """Markdown: one row per zero-shot set ("distance" mode) and per retrieval set of the default run."""
    lines = [f"Measured: `{results['command']}` on {results['machine']}, {results['wall_seconds'] / 60:.1f} minutes "
             f"in all (evaluation included), torch {results['torch']}.", "",
             "| set | domain | top-1 | top-5 | chance (top-1) |", "|---|---|---|---|---|"]
    for item in results["records"]:
        metrics = item["metrics"]
        if item["task"] == "zeroshot_classification" and metrics.get("mode") == "distance":
            lines.append(f"| {item['dataset']} | {item.get('domain', '')} | {metrics['top1']:.1f} | {metrics['top5']:.1f} "
                         f"| {100 / metrics['classes']:.1f} |")
    lines += ["", "| retrieval set | domain | image R@1 | text R@1 | mean recall |", "|---|---|---|---|---|"]
    for item in results["records"]:
        metrics = item["metrics"]
        if item["task"] == "zeroshot_retrieval":
            lines.append(f"| {item['dataset']} | {item.get('domain', '')} | {metrics['image_retrieval_recall@1']:.1f} "
                         f"| {metrics['text_retrieval_recall@1']:.1f} | {metrics['mean_recall']:.1f} |")
    if "temperature" in results:
        lines += ["", f"Final {results['temperature']}."]
    return "\n".join(lines)


def describe_machine(machine: dict) -> str:
    """"Linux-…-x86_64, 2 CPU cores, no GPU, torch 2.13.0+cpu" from the machine record of an ablation."""
    return (f"{machine['platform'].split('-with')[0]}, {machine['cpus']} CPU cores"
            + (f", {machine['gpu']}" if machine.get("gpu") else ", no GPU") + f", torch {machine['torch']}")


def compare_table(results: dict) -> str:
    """Markdown of `topoclip compare`'s JSON: how it was run, and its table with today's statistics, recomputed
    from each row's per-seed values."""
    values = {row["metric"]: {model: row[model]["values"] for model in MODELS} for row in results["rows"]}
    return (f"Measured: `{results['command']}` ({len(results['seeds'])} seeds) on {describe_machine(results['machine'])}.\n\n"
            + compare_markdown(comparison_rows(values), len(results["seeds"]), results["steps"]))


def ablation_table(results: dict) -> str:
    """Markdown of `topoclip ablate`'s JSON: how it was run, then the table it wrote (its rows)."""
    if "parts" in results:
        raise ValueError(f"{', '.join(results['parts'])} are parts of one grid, each with its own table; a block of the "
                         f"whole is a -tests or -convergence spec that reads it")
    minutes = sorted(r["train_seconds"] / 60 for r in results["runs"])
    reused = sum(r["reused_from"] is not None for r in results["runs"])
    seeds = f"{results['seeds']} seed{'s' * (results['seeds'] != 1)}"
    lines = [f"{len(results['runs'])} runs ({len(results['rows'])} cells × {seeds}, "
             f"{results['steps']} steps each) on {describe_machine(results['machine'])}; one run "
             f"took {minutes[0]:.1f}–{minutes[-1]:.1f} min (median {minutes[len(minutes) // 2]:.1f}; from its start to "
             f"its final evaluation, the pause of a run stopped and resumed included)"
             + (f"; {reused} of them are the identical runs of another grid (`--reuse`)" if reused else "")
             + f". Tabulated by `{results['command']}`.", ""]
    table = markdown_table(load_grid(results["grid"]), results["rows"], results)
    return "\n".join(lines + [line for line in table.splitlines() if line.startswith("|")])


def experts_values(runs: list[dict]) -> dict[str, dict[int, list[float]]]:
    """{set: {k: [each run's mean top-1 over its draws]}} from `topoclip analyze experts` JSONs."""
    values: dict[str, dict[int, list[float]]] = {}
    for run in runs:
        for name, result in run["sets"].items():
            for point in result["subsets"]:
                values.setdefault(name, {}).setdefault(point["k"], []).append(point["mean"])
    return values


# The paper's Table 10: ImageNet zero-shot top-1 of CLIP[Multi(32,16)] from k random [CLS] tokens of its 16
# (mean ± std over its draws), and all 16 (Table 2's ImageNet zero-shot top-1 of the same model).
PAPER_SUB_SPHERES = 16
PAPER_TABLE_10 = {1: "13.0 ± 9.7", 2: "21.5 ± 14.3", 4: "27.7 ± 20.4", 8: "62.1 ± 4.4", 16: "76.4 (Table 2)"}


def experts_table(runs: list[dict]) -> str:
    """Markdown: zero-shot top-1 from k of the m sub-spheres, mean ± std over the runs (each a mean over draws),
    and the paper's Table 10 row placed like for like: under our k of m, the paper's k of 16 with the same share
    of the sub-spheres (our k = 4 of 8 beside its k = 8 of 16)."""
    values = experts_values(runs)
    sizes = sorted({k for per_k in values.values() for k in per_k})
    m = max(sizes)
    same_share = {k: k * PAPER_SUB_SPHERES // m for k in sizes if k * PAPER_SUB_SPHERES % m == 0}
    paper = {k: PAPER_TABLE_10.get(same_share.get(k)) for k in sizes}
    lines = [f"{len(runs)} runs (seeds), {runs[0]['draws']} random subsets per k (every subset when fewer), "
             f"{runs[0]['size']} test images per set, {runs[0]['mode']} mode.", "",
             "| set | chance | " + " | ".join(f"k = {k} of {m}" for k in sizes) + " |", "|---|---|" + "---|" * len(sizes)]
    for name, per_k in values.items():
        cells = [f"{mean:.1f} ± {sd:.1f}" for mean, sd in (mean_std(per_k[k]) for k in sizes)]
        lines.append(f"| {name} | {100 / runs[0]['sets'][name]['classes']:.1f} | " + " | ".join(cells) + " |")
    shown = [same_share[k] for k in sizes if paper[k]]
    lines.append(f"| *paper: ImageNet-1k, the same share of its {PAPER_SUB_SPHERES} sub-spheres "
                 f"(k = {', '.join(map(str, shown))}; ± over draws)* | *0.1* | "
                 + " | ".join(f"*{paper[k]}*" if paper[k] else "—" for k in sizes) + " |")
    unplaced = [f"k = {k} ({value})" for k, value in PAPER_TABLE_10.items() if k not in shown]
    return "\n".join(lines + (["", f"The paper's {', '.join(unplaced)} of {PAPER_SUB_SPHERES}: no share of ours matches."]
                               if unplaced else []))


def equilibrium_table(runs: list[dict], batch_size: int = 128) -> str:
    """Markdown: per group of runs (files GROUP-seed-K.json), the learned τ beside τ* (the τ minimising the loss
    of the trained model's fixed embeddings) with p % of captions shuffled, mean ± std over the group's runs."""
    fractions = sorted({c["fraction"] for c in runs[0]["curves"]})
    split = runs[0].get("split", "test")  # written since `analyze equilibrium --split`; test before it
    pairs = "training pairs (the scenes the models trained on)" if split == "train" else f"{split} pairs"
    lines = [f"Batches of {batch_size} built-in {pairs}, {runs[0]['draws']} draws each; τ* is read on a grid of "
             f"{len(runs[0]['scales'])} values from {runs[0]['scales'][0]:g} to {runs[0]['scales'][-1]:g} (×1.26 apart).",
             "", "| runs | topology | seeds | learned τ | " + " | ".join(f"τ* at {p:.0%} shuffled" for p in fractions)
             + " |", "|---|---|---|---|" + "---|" * len(fractions)]
    for group in dict.fromkeys(run["file"].rsplit("-seed-", 1)[0] for run in runs):
        chosen = [run for run in runs if run["file"].rsplit("-seed-", 1)[0] == group]
        columns = [mean_std([run["model_scale"] for run in chosen])]
        columns += [mean_std([c["best_scale"] for run in chosen for c in run["curves"]
                              if c["fraction"] == p and c["batch_size"] == batch_size]) for p in fractions]
        lines.append(f"| {group} | {chosen[0]['topology']} | {len(chosen)} | "
                     + " | ".join(f"{m:.1f} ± {sd:.1f}" for m, sd in columns) + " |")
    return "\n".join(lines)


def similarities_table(runs: list[dict]) -> str:
    """Markdown (the paper's Fig. 6 as numbers): per model and domain, the median similarity of each kind of pair,
    the positive–negative image–text gap as a fraction of the similarity's range, and the share of negative
    image–text pairs above the median positive, from `topoclip analyze similarities` JSONs."""
    from topoclip.core.geometry import get_topology

    kinds = ("positive image-text", "negative image-text", "negative image-image", "negative text-text")
    lines = [f"{runs[0]['size']} test pairs per domain; median s in the topology's own units (a sum of m cosines for "
             "the product sphere, so in [−m, m]; −‖u − v‖ for Euclidean, so unbounded below).", "",
             "| model | topology | domain | " + " | ".join(f"median s, {kind}" for kind in kinds)
             + " | image–text gap / range of s | negative image–text above the median positive |",
             "|---|---|---|" + "---|" * (len(kinds) + 2)]
    for run in runs:
        low, high = get_topology(run["topology"]).similarity_range(run["spheres"])
        for domain, record in run["domains"].items():
            summed = record["summed"]
            medians = [summed[kind]["median"] for kind in kinds]
            gap = f"{(medians[0] - medians[1]) / (high - low):.3f}" if math.isfinite(high - low) else "— (unbounded)"
            lines.append(f"| {run['file']} | {run['topology']} | {domain} | " + " | ".join(f"{m:.2f}" for m in medians)
                         + f" | {gap} | "
                         f"{summed['negatives_above_median_positive']:.1%} |")
    return "\n".join(lines)


def false_negatives_table(result: dict) -> str:
    """Markdown: how often a training batch holds a caption true of another of its images
    (scripts/false_negatives.py)."""
    return "\n".join([
        f"{result['batches']} batches of {result['batch_size']} from the {result['split']} split of {result['preset']} "
        f"(seed {result['seed']}; `python scripts/false_negatives.py`).", "",
        "| query | queries with ≥ 1 false negative in the batch | false negatives per query |", "|---|---|---|",
        f"| a caption (text → image) | {100 * result['text_queries_with_a_false_negative']:.1f} % | "
        f"{result['false_negatives_per_text_query']:.1f} |",
        f"| an image (image → text) | {100 * result['image_queries_with_a_false_negative']:.1f} % | "
        f"{result['false_negatives_per_image_query']:.1f} |", "",
        f"{100 * result['queries_whose_caption_has_an_exact_duplicate']:.1f} % of the captions have a word-for-word "
        "duplicate in their batch."])


def cell_values(source: str, cell: str, metric: str, set_name: str = "") -> list[float]:
    """Each seed's value of one metric of one cell of the results in docs/results/SOURCE.

    An ablation: metric is a Table 6 column of its runs (final_t, i2t_r1, t2i_r1, zero_shot_top1,
    linear_probe_top1, convergence_step), "tau" (exp of each run's final t), "headline:KEY" (a metric of
    each run's final evaluation) or "retrieval:SET/KEY" (any retrieval metric of it, mAP@R and R-Precision too).
    A compare: cell is "multi" or "sphere", metric a row of its table.
    The experts: cell is k, set_name the zero-shot set.
    """
    results = load_results(source)
    if source == "experts":
        return experts_values(results)[set_name][int(cell)]
    if results.get("analysis") == "compare":
        return next(row[cell]["values"] for row in results["rows"] if row["metric"] == metric)
    runs = [r for r in results["runs"] if r["cell"] == cell]
    if not runs:
        raise KeyError(f"{source} has no cell {cell!r}")
    if cell in results.get("unfinished", {}):  # a grid in parts (`pooled`) still running
        raise ValueError(f"{source}'s {cell} has {len(runs)} of its {results['seeds']} seeds so far: wait for the rest")
    if metric == "tau":
        return [math.exp(r["final_t"]) for r in runs]
    if metric.startswith("headline:"):
        return [r["headline"][metric.split(":", 1)[1]] for r in runs]
    if metric.startswith("retrieval:"):  # retrieval:SET/KEY, any metric of the final retrieval evaluation
        set_name, key = metric.split(":", 1)[1].split("/", 1)
        old = next((r for r in runs if "retrieval" not in r), None)
        if old is not None:  # a grid in parts (`pooled`): the part's
            raise KeyError(f"{old.get('part', source)}'s ablation.json predates the runs' retrieval metrics; re-run its "
                           f"ablate command to tabulate it again (nothing is retrained)")
        return [r["retrieval"][set_name][key] for r in runs]
    return [r[metric] for r in runs]


def measured(item: dict) -> str:
    """"label mean ± std (n)" of one measurement of a claim."""
    values = cell_values(item["source"], item["cell"], item["metric"], item.get("set", ""))
    mean, std = mean_std(values)
    digits = item.get("digits", 1)
    return f"{item['label']} {mean:.{digits}f} ± {std:.{digits}f}"


def difference(item: dict):
    """Welch's t of one comparison of a claim: cell a − cell b (each [source, cell]) on its metric."""
    return welch(*(cell_values(source, cell, item["metric"], item.get("set", "")) for source, cell in (item["a"], item["b"])))


def tested(items: list[dict]) -> list[str]:
    """"label: +15.2 (95 % CI …; Welch's t, p = …, Holm p = …; n = 3 and 3)" for each comparison of a claim: Welch's t
    between two cells (`a` − `b`, each [source, cell]) on one metric, with the p-values adjusted by Holm's method over
    the claim's comparisons (those with a spread to test)."""
    differences = [difference(item) for item in items]
    adjusted = iter(holm([d.p for d in differences if not d.unvaried]))
    return [f"{item['label']}: {d.describe(item.get('digits', 1), None if d.unvaried else next(adjusted))}"
            for item, d in zip(items, differences)]


def comparison_table(spec: dict) -> str:
    """Markdown: Welch's t of each comparison (a − b) on each metric; spec is docs/results/NAME.json:
    {"source": ablation, "metrics": [{"metric", "label", "digits"?}], "rows": [{"label", "a", "b"}]}, where a
    and b are cells of the source, or [ablation, cell] pairs for cells of other results. Bold: the 95 % interval
    excludes 0; †: so does Holm's adjustment over every test of the table. A metric with "permutation": true (values
    bimodal across seeds) also gets, under the table, each row's values seed by seed and the exact permutation p."""
    metrics = spec["metrics"]

    def sides(row: dict, metric: dict) -> tuple[list[float], list[float]]:
        a, b = (cell_values(*(ref if isinstance(ref, list) else (spec["source"], ref)), metric["metric"])
                for ref in (row["a"], row["b"]))
        return a, b

    differences = [[welch(*sides(row, metric)) for metric in metrics] for row in spec["rows"]]
    tested = [d for row in differences for d in row if not d.unvaried]  # a fixed τ in both cells: nothing to test
    adjusted = iter(holm([d.p for d in tested]))  # in the order of `tested`: row by row
    kept = [[not d.unvaried and next(adjusted) < 0.05 for d in row] for row in differences]
    lines = [spec.get("about", ""), "", "| comparison | " + " | ".join(m["label"] for m in metrics) + " |",
             "|---|" + "---|" * len(metrics)]
    for row, row_differences, row_kept in zip(spec["rows"], differences, kept):
        cells = []
        for metric, d, holds in zip(metrics, row_differences, row_kept):
            digits = metric.get("digits", 1)
            if d.unvaried:
                cells.append(f"{d.effect:+.{digits}f} (no spread)")
                continue
            bold = "**" if d.significant else ""
            cells.append(f"{bold}{d.effect:+.{digits}f}{bold}{'†' * holds} "
                         f"({d.low:+.{digits}f} to {d.high:+.{digits}f}), {format_p(d.p)}")
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    sizes = ", ".join(f"{a} and {b}" for a, b in sorted({(d.n_a, d.n_b) for row in differences for d in row}))
    lines += ["", f"Each cell: the difference of means a − b, its 95 % confidence interval and the p-value of "
                  f"Welch's t; n = {sizes} runs; bold where the interval excludes 0, † where the difference stays "
                  f"significant after Holm's adjustment over the table's {len(tested)} tests "
                  f"({sum(map(sum, kept))} of the {sum(d.significant for d in tested)} bold ones)."
              + (" \"No spread\": every run of both cells gave the same value, so there is nothing to test."
                 if len(tested) < sum(map(len, differences)) else "")]
    for metric in (m for m in metrics if m.get("permutation")):
        for row in spec["rows"]:
            a, b = sides(row, metric)
            digits = metric.get("digits", 1)
            lines += ["", f"{metric['label']}, {row['label']}, seed by seed: a = {', '.join(f'{v:.{digits}f}' for v in a)}; "
                          f"b = {', '.join(f'{v:.{digits}f}' for v in b)}; exact permutation test of a − b, "
                          f"{format_p(permutation(a, b))}."]
    if spec.get("reruns"):
        lines += ["", rerun_table(spec["source"], spec["reruns"], metrics)]
    return "\n".join(line for line in lines if line is not None).lstrip("\n")


def pooled_values(refs: list, metric: str) -> list[float]:
    """One metric of the seeds of one cell spread over several grids ([[source, cell], ...]: more seeds of a grid
    trained later, `ablate --first-seed`); refused when a seed appears twice or the grids' schedules differ."""
    values, seeds, steps = [], set(), set()
    for source, cell in refs:
        results = load_results(source)
        found = [r["seed"] for r in results["runs"] if r["cell"] == cell]
        if seeds & set(found) or len(set(found)) < len(found):
            raise ValueError(f"{source}'s {cell} repeats a seed of {refs}: a run would be counted twice")
        seeds |= set(found)
        steps.add(results["steps"])
        values += cell_values(source, cell, metric)
    if len(steps) > 1:
        raise ValueError(f"{refs} pools runs of {sorted(steps)} steps: one cell is one schedule")
    return values


def equivalence_table(spec: dict) -> str:
    """Markdown: a pre-registered comparison (docs/results/NAME-equivalence.json: {"about", "margin", "rows": [{"label",
    "metric", "digits"?, "a": [[source, cell], ...], "b": [...]}], "seeds"?}; each side's seeds pooled over its
    sources): Welch's t of a − b decides; where it finds no difference, TOST against ±margin does, as the
    pre-registration says, and where it finds one, TOST says whether it is smaller than the margin. "seeds": the runs
    a side was registered with; a side with fewer (a grid still running) is refused."""
    margin = spec["margin"]
    lines = [spec["about"], "", f"| endpoint | n (a, b) | a − b: 95 % CI, Welch's t | TOST at ±{margin:g}: 90 % CI, p | "
             "verdict |", "|---|---|---|---|---|"]
    for row in spec["rows"]:
        a, b = (pooled_values(refs, row["metric"]) for refs in (row["a"], row["b"]))
        if len(a) < spec.get("seeds", 0) or len(b) < spec.get("seeds", 0):
            raise ValueError(f"{row['label']}: {len(a)} and {len(b)} runs of the {spec['seeds']} a side registered")
        d, e, digits = welch(a, b), tost(a, b, margin), row.get("digits", 1)
        verdict = ("a > b" if d.effect > 0 else "a < b") if d.significant else (
            f"equivalent within ±{margin:g}" if e.equivalent else "undecided: no difference shown, nor equivalence")
        if d.significant and e.equivalent:  # a difference shown, and shown smaller than the margin
            verdict += f", by less than ±{margin:g}"
        lines.append(f"| {row['label']} | {len(a)}, {len(b)} | {d.effect:+.{digits}f} ({d.low:+.{digits}f} to "
                     f"{d.high:+.{digits}f}), {format_p(d.p)} | {e.low:+.{digits}f} to {e.high:+.{digits}f}, "
                     f"{format_p(e.p)} | **{verdict}** |")
    return "\n".join(lines + ["", "Welch's t, two-sided at 5 %; where its interval holds 0, two one-sided Welch tests "
                                   f"at 5 % (TOST) decide: equivalent when the 90 % interval lies inside ±{margin:g}. "
                                   "Where Welch's t finds a difference, TOST says whether it is smaller than the margin."])


def last_quarter(runs: list[dict], steps: int) -> dict:
    """Validation mean recall and τ over the last quarter of the schedule (three quarters → the end), each: the paired t
    of the change over the seeds and the seed-to-seed sd at the end."""
    recall = []
    for run in runs:
        logged = {e["step"]: e[CHOICE_METRIC] for e in run["evaluations"]}
        if steps not in logged:
            raise ValueError(f"{run['cell']} seed {run['seed']} has no validation evaluation at step {steps:,}")
        quarter = min(logged, key=lambda step: abs(step - 0.75 * steps))
        recall.append((logged[quarter], logged[steps]))
    starts, ends, tau = tau_last_quarter(runs)
    return {"recall": (paired([end for _, end in recall], [start for start, _ in recall]), mean_std([end for _, end in recall])[1]),
            "tau": (tau, mean_std(ends)[1])}


def convergence_table(spec: dict) -> str:
    """Markdown: the pre-registered convergence rule for each cell of a schedule pair (docs/results/NAME-convergence.json:
    {"about", "short": grid, "long": grid, "cells": [...]}). "Converged" only where, in the long grid, validation mean
    recall and τ each change over the last quarter by less than their seed-to-seed sd and not significantly (paired t,
    5 %), and the long schedule's test mean recall is not significantly better than the short one's (Welch's t);
    otherwise "at the end of the schedule". A cell that either grid has not run yet, or not all its seeds (a grid in
    parts, `pooled`), says so (its runs under way)."""
    long, short = load_results(spec["long"]), load_results(spec["short"])
    lines = [spec["about"], "", "| cell | validation mean recall, last quarter (sd) | τ, last quarter (sd) | test mean recall, "
             f"{long['steps']:,} − {short['steps']:,} steps | verdict |", "|---|---|---|---|---|"]
    for cell in spec["cells"]:
        runs = [r for r in long["runs"] if r["cell"] == cell]
        if not runs or not any(r["cell"] == cell for r in short["runs"]):
            lines.append(f"| {cell} | | | | not run yet |")
            continue
        if cell in long.get("unfinished", {}):
            lines.append(f"| {cell} | | | | {len(runs)} of its {long['seeds']} seeds so far |")
            continue
        if len(runs) < 2:
            raise ValueError(f"{spec['long']}: cell {cell} has {len(runs)} runs; the rule needs ≥ 2")
        changes = last_quarter(runs, long["steps"])
        longer = welch(cell_values(spec["long"], cell, "headline:scenes-test/mean_recall"),
                       cell_values(spec["short"], cell, "headline:scenes-test/mean_recall"))
        flat = all(not d.significant and abs(d.effect) < sd for d, sd in changes.values())
        converged = flat and not (longer.significant and longer.effect > 0)
        shown = [f"{d.effect:+.{k}f} ({d.low:+.{k}f} to {d.high:+.{k}f}), {format_p(d.p)} ({sd:.{k}f})"
                 for (d, sd), k in zip(changes.values(), (1, 2))]
        lines.append(f"| {cell} | {shown[0]} | {shown[1]} | {longer.effect:+.1f} ({longer.low:+.1f} to {longer.high:+.1f}), "
                     f"{format_p(longer.p)} | **{'converged' if converged else 'at the end of the schedule'}** |")
    return "\n".join(lines + ["", "Each change: mean and 95 % interval over the seeds, the paired t's p, and in brackets the "
                                   "seeds' sd at the end. Converged: each change smaller than that sd and not significant, "
                                   "and the longer schedule not significantly better on test mean recall "
                                   "(preregistration-hard-task.md)."])


def rerun_table(source: str, cells: list[str], metrics: list[dict]) -> str:
    """Markdown: for each cell, where one more seed lands on each metric (mean and 95 % prediction interval, cut
    to the metric's "bounds" where it has them)."""
    lines = ["| one more seed of | " + " | ".join(m["label"] for m in metrics) + " |", "|---|" + "---|" * len(metrics)]
    counts = set()
    for cell in cells:
        row = []
        for metric in metrics:
            p, digits = prediction(cell_values(source, cell, metric["metric"])), metric.get("digits", 1)
            low, high = metric.get("bounds", (-math.inf, math.inf))  # a percentage cannot leave [0, 100]
            counts.add(p.n)
            row.append(f"{p.mean:.{digits}f} ({max(p.low, low):.{digits}f} to {min(p.high, high):.{digits}f})")
        lines.append(f"| {cell} | " + " | ".join(row) + " |")
    sizes = " or ".join(str(n) for n in sorted(counts))
    return "\n".join(lines + ["", f"Each cell: the mean of the n = {sizes} runs and the 95 % prediction interval "
                                   "for one more run, mean ± t(0.975, n − 1)·sd·√(1 + 1/n): if the runs of a cell "
                                   "spread normally, a run with a new seed lands inside it 19 times in 20 (cut to "
                                   "the metric's range, 0–100 for a percentage)."])


def reruns_table(spec: dict) -> str:
    """Markdown: where one more seed of each cell lands (docs/results/NAME-reruns.json: {"about", "source", "cells",
    "metrics": [{"metric", "label", "bounds"?, "digits"?}]}), the figure a re-run on another machine is checked against."""
    return "\n".join([spec["about"], "", rerun_table(spec["source"], spec["cells"], spec["metrics"])])


def claims_summary_table(claims: dict) -> str:
    """Markdown, one screen: each claim in a few words, our verdict in a few more, the comparisons that carry it
    (Welch's t, recomputed) and the page with the detail."""
    lines = ["| claim | verdict | the numbers that carry it (a − b, 95 % CI, p, n) | detail |", "|---|---|---|---|"]
    for number, claim in enumerate(claims["claims"], 1):
        numbers = []
        for key in claim["key"]:
            item = claim["tests"][key["test"]]
            d, digits = difference(item), item.get("digits", 1)
            numbers.append(f"{key['label']}: {d.effect:+.{digits}f} ({d.low:+.{digits}f} to {d.high:+.{digits}f}), "
                           f"{format_p(d.p)}, n {d.n_a}/{d.n_b}")
        lines.append(f"| {claim['short']} | **{claim['answer']}** | {'; '.join(numbers)} | [the tests](claims.md#claim-{number}); "
                     f"[{claim['page']}]({claim['page']}) |")
    return "\n".join(lines)


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
        if not all((RESULTS / grid / "ablation.json").is_file() for grid in grids):
            continue
        if not all({multi, sphere} <= {r["cell"] for r in load_results(grid)["runs"]} for grid in grids):
            continue
        differences = {name: welch(pooled_values([[grid, multi] for grid in grids], metric),
                                   pooled_values([[grid, sphere] for grid in grids], metric))
                       for name, metric in HEADLINE_METRICS.items()}
        if min(d.n_a for d in differences.values()) < 2 or min(d.n_b for d in differences.values()) < 2:
            continue
        points.append({"task": task, "lr": lr, "noise": noise, "steps": load_results(grids[0])["steps"], "grids": grids,
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
                     + " | ".join(cells) + " | " + ", ".join(f"[{grid}]({grid}/ablation.json)" for grid in point["grids"]) + " |")
    return "\n".join(lines + ["", "Each cell: the difference of the seed means and its 95 % interval (Welch's t); bold where "
                                   "the interval excludes 0. Where a row names two grids, the second added seeds of the same "
                                   "recipe after the first's results were known." + reused_runs(points) + " Drawn in headline.png."])


def reused_runs(points: list[dict]) -> str:
    """" N of the M runs of GRID's row are SOURCE's (…)": a row's runs that are copies (`ablate --reuse`) of another
    grid's, which are then not new evidence beside that grid (e.g. the runs that chose an lr)."""
    said = []
    for point in points:
        for grid in point["grids"]:
            runs = [r for r in load_results(grid)["runs"] if r["cell"] in point["cells"]]
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

    if not path.is_file():
        return None
    with Image.open(path) as image:
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


def claims_table(claims: dict) -> str:
    """Markdown, a section per claim (anchor claim-N, which the short table links): the paper's claim and numbers, ours
    (mean ± sample std over seeds), Welch's t for each comparison the claim rests on, and the verdict with its why."""
    lines = []
    for number, claim in enumerate(claims["claims"], 1):
        lines += [f'<a id="claim-{number}"></a>', "", f"### {number}. {claim['short']}", "", f"**The claim.** {claim['claim']}",
                  "", f"**The paper's numbers.** {claim['paper']}", "", "**Measured here** (mean ± sample std over seeds): "
                  + "; ".join(measured(item) for item in claim["measured"]) + ".", "",
                  "**The comparisons** (Welch's t: difference of means, 95 % CI, p, Holm's p over the claim's comparisons, "
                  "n per cell):", "", *(f"- {line}" for line in tested(claim.get("tests", [])) or ["—"]), "",
                  f"**Verdict: {claim['verdict']}.** {claim['why']}", ""]
    return "\n".join(lines[:-1])


CEILING_ROWS = (("text → image R@1", "image_retrieval_recall@1"), ("text → image R@5", "image_retrieval_recall@5"),
                ("text → image R@10", "image_retrieval_recall@10"), ("image → text R@1", "text_retrieval_recall@1"),
                ("image → text R@5", "text_retrieval_recall@5"), ("image → text R@10", "text_retrieval_recall@10"),
                ("mean recall", "mean_recall"))
# mAP@R and R-Precision count every caption true of an image, not only the paired one; their ceiling is not computed.
RANK_ROWS = (("image → text mAP@R", "image_to_text_mAP@R"), ("text → image mAP@R", "text_to_image_mAP@R"),
             ("image → text R-Precision", "image_to_text_R-Precision"), ("text → image R-Precision", "text_to_image_R-Precision"))


def ceiling_table(result: dict) -> str:
    """The Bayes-optimal ranking's recall on the built-in retrieval set (`topoclip data ceiling`)."""
    expected, this_set = result["ceiling"]["expected"], result["ceiling"]["this_set"]
    settings = "".join(f" --set {item}" for item in result.get("overrides", []))
    lines = [f"Measured: `topoclip data ceiling --preset {result['preset']}{settings}` ({result['split']} split, "
             f"{result['size']:,} images, {result['captions_per_image']} captions each).", "",
             "| metric | ceiling on this set | ceiling expected over the generator |", "|---|---|---|"]
    lines += [f"| {label} | {this_set[key]:.1f} | {expected[key]:.1f} |" for label, key in CEILING_ROWS]
    return "\n".join(lines)


def retrieval_table(spec: dict) -> str:
    """Markdown: every retrieval metric of some cells (mean ± sd over seeds) beside the ceiling of each
    (docs/results/NAME-retrieval.json: {"about", "ceiling": results name, "set", "cells": [{"label", "source", "cell"}]})."""
    ceiling = load_results(spec["ceiling"])["ceiling"]["this_set"]
    lines = [spec["about"], "", "| metric | ceiling | " + " | ".join(c["label"] for c in spec["cells"]) + " |",
             "|---|---|" + "---|" * len(spec["cells"])]
    for label, key in CEILING_ROWS + RANK_ROWS:
        values = [mean_std(cell_values(c["source"], c["cell"], f"retrieval:{spec['set']}/{key}")) for c in spec["cells"]]
        bound = f"{ceiling[key]:.1f}" if key in ceiling else "—"
        lines.append(f"| {label} | {bound} | " + " | ".join(f"{m:.1f} ± {sd:.1f}" for m, sd in values) + " |")
    return "\n".join(lines + ["", f"Each cell: mean ± sd over its seeds, on {spec['set']}. The ceiling is the Bayes-optimal "
                                   "ranking's on the same set (`topoclip data ceiling`); mAP@R and R-Precision count every "
                                   "true caption, so the paired-caption ceiling does not bound them and none is given."])


def pilot_table(files: list[dict]) -> str:
    """Markdown of a difficulty pilot (hard-task-pilot/pilot.json: one run per model, each its eval.json records)."""
    lines = []
    for pilot in files:
        lines += [f"Measured: `{pilot['command']}` (seed {pilot['seed']}, commit {pilot['commit']}).", "",
                  "| model | shape top-1 | in-domain mean recall | out-of-domain mean recall |", "|---|---|---|---|"]
        for model, records in pilot["runs"].items():
            found = {(r["dataset"], r["metrics"].get("mode")): r["metrics"] for r in records}
            lines.append(f"| {model} | {found['shape', 'distance']['top1']:.1f} | "
                         f"{found['scenes-test', None]['mean_recall']:.1f} | {found['scenes-test-ood', None]['mean_recall']:.1f} |")
    return "\n".join(lines)


# The pre-registered rule (docs/results/preregistration-hard-task.md): a family's best lr is the cell whose runs
# have the highest mean validation mean recall at the end of the schedule.
CHOICE_METRIC = "scenes-val/mean_recall"
LR_CHOICE = "lr-choice-"  # a block "lr-choice-GRID": lr_choice_table of GRID (and GRID-final-validation.json)


def end_of_schedule_validation(results: dict) -> dict[str, list[float]]:
    """{cell: each seed's validation mean recall at the schedule's last step}: the run's own evaluation there, or,
    for a run trained before the trainer evaluated the validation split at the last step, the value
    scripts/final_validation.py measured on its final weights (results["final_validation"])."""
    final = {(r["cell"], r["seed"]): r["eval"][CHOICE_METRIC] for r in results.get("final_validation", {}).get("runs", [])
             if r["step"] == results["steps"]}
    values: dict[str, list[float]] = {}
    for run in results["runs"]:
        last = run["evaluations"][-1] if run["evaluations"] else {}
        if last.get("step") == results["steps"]:
            value = last[CHOICE_METRIC]
        elif (run["cell"], run["seed"]) in final:
            value = final[run["cell"], run["seed"]]
        else:
            raise ValueError(f"{run['cell']} seed {run['seed']} has no validation evaluation at step {results['steps']:,}; "
                             f"run scripts/final_validation.py on its grid")
        values.setdefault(run["cell"], []).append(value)
    return values


def lr_choice(results: dict) -> dict[str, str]:
    """{family: the cell the pre-registered rule picks} of an lr grid whose cells are FAMILY_lr-LR."""
    best: dict[str, tuple[float, str]] = {}
    for cell, values in end_of_schedule_validation(results).items():
        family, mean = cell.split("_lr-")[0], mean_std(values)[0]
        if family not in best or mean > best[family][0]:
            best[family] = (mean, cell)
    return {family: cell for family, (_, cell) in best.items()}


def lr_choice_table(results: dict) -> str:
    """Markdown: each cell of an lr grid on the rule's validation metric and the test metrics, the picked cells bold."""
    chosen = set(lr_choice(results).values())
    validation = end_of_schedule_validation(results)
    lines = [f"| family | lr | n | validation mean recall at step {results['steps']:,} (the rule) | test mean recall | "
             "out-of-domain mean recall | zero-shot top-1 |", "|---|---|---|---|---|---|---|"]
    for cell, values in validation.items():
        runs = [r for r in results["runs"] if r["cell"] == cell]
        columns = [values, [r["headline"]["scenes-test/mean_recall"] for r in runs],
                   [r["headline"]["scenes-test-ood/mean_recall"] for r in runs], [r["zero_shot_top1"] for r in runs]]
        family, lr = cell.split("_lr-")
        bold = "**" if cell in chosen else ""
        lines.append(f"| {family} | {bold}{lr}{bold} | {len(runs)} | "
                     + " | ".join("{:.1f} ± {:.1f}".format(*mean_std(column)) for column in columns) + " |")
    return "\n".join(lines + ["", "Each cell: mean ± sd over the seeds. Bold: the lr the pre-registered rule picks for the "
                                   "family, the highest mean validation mean recall at the end of the schedule; the test "
                                   "columns played no part in it. The validation split has fewer images per set "
                                   "(evaluate.validation_size) than the test split, so its recall is higher."])


def run_origin(grids: dict[str, dict], grid: str, run: dict) -> str:
    """"GRID/runs/CELL/seed-K" of the run a record copies (`--reuse`, followed through copies of copies), or of the
    record itself: two records with one origin are one run."""
    for _ in range(len(grids) + 1):
        if not run.get("reused_from"):
            break
        target = os.path.normpath(f"{grid}/{run['reused_from']}")
        grid, _, run_dir = target.partition("/")
        found = next((r for r in grids.get(grid, {}).get("runs", []) if r["run_dir"] == run_dir), None)
        if found is None:  # copied from a folder that is not in docs/results
            return target
        run = found
    return f"{grid}/{run['run_dir']}"


def tau_last_quarter(runs: list[dict]):
    """Each run's τ at three quarters of its schedule and at its end (from its curve), and the paired t of the change."""
    starts, ends = [], []
    for run in runs:
        steps, scale = run["curve"]["steps"], run["curve"]["scale"]
        quarter = min(range(len(steps)), key=lambda k: abs(steps[k] - 0.75 * steps[-1]))
        starts.append(scale[quarter])
        ends.append(scale[-1])
    return starts, ends, paired(ends, starts)


def tau_late_rise() -> list[dict]:
    """Every learnable-τ cell of the committed grids at ≥ 9,600 steps, each run once (a cell another grid copied with
    `--reuse`, whole or in part, is counted where it was trained): τ at three quarters of the schedule and at its end (the
    seeds' curves), and the paired t of the change. The cells of a grid trained in parts (`pooled`) are its pool's,
    once all their seeds have landed."""
    grids = {file.parent.name: json.loads(file.read_text()) for file in sorted(RESULTS.glob("*/ablation.json"))}
    pool_of, unfinished = {}, set()
    for pool, spec in pools().items():
        unfinished |= {(pool, cell) for cell in pooled(pool, spec)["unfinished"]}  # still running: not yet counted
        for part in spec["parts"]:
            if pool_of.setdefault(part, pool) != pool:
                raise ValueError(f"{part} is a part of both {pool_of[part]} and {pool}: its runs would count twice")
    cells: dict[tuple[str, str], list[dict]] = {}
    for name, grid in grids.items():
        if (grid.get("steps") or 0) >= 9600:
            for run in grid["runs"]:
                key = (pool_of.get(name, name), run["cell"])
                if run.get("learnable", True) and run["curve"]["steps"] and key not in unfinished:
                    cells.setdefault(key, []).append({**run, "folder": name})
    found, counted = [], set()
    # Each run once: the larger cells first, so that three of five seeds copied elsewhere (or three seeds that
    # another grid extended to five) are counted in the five; among cells of one size, the one trained in its grid
    # first, so that a set of runs is named where it was trained. A cell sharing a run with one counted is left out.
    for (name, cell), runs in sorted(cells.items(), key=lambda item: (-len(item[1]),
                                                                      any(r.get("reused_from") for r in item[1]))):
        origins = {run_origin(grids, run["folder"], run) for run in runs}
        if len(runs) < 2 or origins & counted:
            continue
        counted |= origins
        starts, ends, change = tau_last_quarter(runs)
        found.append({"grid": name, "cell": cell, "n": len(runs), "tau_three_quarters": sum(starts) / len(starts),
                      "tau_end": sum(ends) / len(ends), "change": change.effect, "low": change.low, "high": change.high,
                      "p": change.p})
    return sorted(found, key=lambda row: (row["grid"], row["cell"]))


def tau_late_rise_table(rows: list[dict]) -> str:
    rising = [row for row in rows if row["p"] < 0.05 and row["change"] > 0]
    lines = [f"τ still rises over the last quarter of the schedule in **{len(rising)} of {len(rows)}** learnable-τ cells "
             f"trained ≥ 9,600 steps, each run counted once (paired t over the seeds, 5 %, unadjusted); it falls "
             f"significantly in none.", "",
             "| grid | cell | n | τ at ¾ | τ at the end | change (95 % CI) | p |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {row['grid']} | {row['cell']} | {row['n']} | {row['tau_three_quarters']:.2f} | {row['tau_end']:.2f} | "
              f"{row['change']:+.2f} ({row['low']:+.2f} to {row['high']:+.2f}) | {format_p(row['p'])} |" for row in rows]
    return "\n".join(lines)


# A block is rendered by its name's entry, a trailing step count aside (equilibrium-9600 as equilibrium,
# equilibrium-train-19200 as equilibrium-train);
# blocks named NAME-tests are comparison tables (comparison_table); any other name is an ablation.
def tests_line(output: str) -> str:
    """pytest's closing counts ("1 failed, 11 passed") from the tail of its output."""
    counts = re.findall(r"((?:\d+ \w+, )*\d+ \w+) in [\d.]+s", output)[-1]
    return re.sub(r", \d+ warnings?", "", counts)


def gpu_check_table(result: dict) -> str:
    """The GPU check (benchmarks/gpu_check.py) as the README shows it: what ran, the ViT-B/16 step, the data path."""
    check = result["check"]
    steps = check["steps"]
    training = steps["training"]
    statuses = ", ".join(f"{name} {step['status']}" for name, step in training.items())
    summary = {(line["model"], line["preset"], name): line for name in ("step_eager", "step_compiled")
               for line in steps[name]["json"] if line.get("benchmark") == "mfu"}
    rows = ["| bf16, batch 256 | sphere-vit-b16 | multi-32x16-vit-b16 | Multi's cost |", "|---|---|---|---|"]
    for name, label in (("step_eager", "eager"), ("step_compiled", "`torch.compile`")):
        cells = []
        for preset in ("sphere-vit-b16", "multi-32x16-vit-b16"):
            ours, theirs = summary[("topoclip", preset, name)], summary[("open_clip ViT-B-16", preset, name)]
            cells.append(f"{ours['median_images_per_s']:,.0f} img/s, MFU {100 * ours['mfu']:.1f} %, "
                         f"{ours['ratio_to_open_clip']:.2f}× OpenCLIP ({theirs['median_images_per_s']:,.0f})")
        sphere, multi = (summary[("topoclip", preset, name)]["median_images_per_s"]
                         for preset in ("sphere-vit-b16", "multi-32x16-vit-b16"))
        rows.append(f"| {label} | {cells[0]} | {cells[1]} | {100 * (1 - multi / sphere):.1f} % |")
    resume = training.get("resume_losses")
    resumed = (f"The run killed with SIGKILL and resumed matched the uninterrupted run's losses at "
               f"{resume['steps_compared']} logged steps (largest relative difference "
               f"{resume['largest_relative_difference']:g}; bound {resume['bound']:g})." if resume else
               "The losses of the killed and resumed run were not compared (a run did not finish).")
    shards = [line for line in steps["shards_vs_random"]["json"] if line.get("benchmark") == "shard_throughput"]
    shards += result["after"]["shards_vs_random"]
    feeding = ", ".join(f"{line['num_workers']} workers {line['shard_to_random']:.2f} "
                        f"({line['shards_images_per_s'] / line['num_workers']:,.0f} images/s per worker)"
                        for line in shards)
    return "\n".join([
        f"Measured: `benchmarks/gpu_check.py` on one {check['gpu']}, torch {check['torch']}, {check['date'][:10]}; "
        f"MFU against the bf16 matmul peak measured in the same run "
        f"({summary[('topoclip', 'sphere-vit-b16', 'step_eager')]['peak_tflop_per_s']:.0f} TFLOP/s).", "",
        *rows, "",
        f"- Training on the GPU: {statuses}. {resumed}",
        f"- `gpu` tests: {tests_line(steps['gpu_tests']['tail'])} in the check; "
        f"{result['after']['gpu_tests']['failed_first'].split(':')[0]} failed and passes after the fix "
        f"({result['after']['gpu_tests']['fix']}).",
        f"- The trainer's data path (256-px JPEG shards) against random tensors, shards/random: {feeding}.",
    ])


def fsdp_memory_table(result: dict) -> str:
    """benchmarks/fsdp_memory.py's launches: per-rank bytes of DDP and FSDP and the largest model a budget holds."""
    gib, budget = 1024**3, result["budget_gib"]
    first = result["launches"][0]
    rows = [f"Measured: `{result['command']}` ({first['preset']}, {first['parameter_count'] / 1e6:.1f} M parameters, "
            f"fp32 AdamW, one step of batch {first['batch']}) on {result['machine']}, torch {result['torch']}. GiB on "
            "the rank that holds the most; the largest model counts parameters, gradients and AdamW state only "
            "(activations and FSDP's gathered block come on top):", "",
            f"| | processes | parameters | gradients | AdamW state | together | peak RSS | largest model in "
            f"{budget:g} GiB per rank |", "|---|---|---|---|---|---|---|---|"]
    for launch in result["launches"]:
        held = max(launch["per_rank"], key=lambda rank: rank["parameters"] + rank["gradients"] + rank["optimizer"])
        total = held["parameters"] + held["gradients"] + held["optimizer"]
        largest = budget * gib / (total / launch["parameter_count"])
        rows.append(f"| {launch['parallelism']} | {launch['world']} | {held['parameters'] / gib:.3f} | "
                    f"{held['gradients'] / gib:.3f} | {held['optimizer'] / gib:.3f} | {total / gib:.3f} | "
                    f"{held['peak_rss'] / gib:.2f} | {largest / 1e9:.1f} B parameters |")
    return "\n".join(rows)


def loader_table(result: dict) -> str:
    """benchmarks/loader.py: images a second one DataLoader worker delivers to the training loop, topoclip's path
    beside the baseline commit's and OpenCLIP's, and the workers the measured GPU step needs."""
    paths = list(next(iter(result["sizes"].values()))["paths"])
    gpu = result.get("gpu_step") or {}
    rows = [f"Measured: `{result['command']}` on {result['machine']} ({result['cores']} cores; {result['note']}), "
            f"batches of {result['batch']}, {result['image_size']} px crops, the median of {result['rounds']} rounds: "
            f"images per second one worker delivers (the whole path: tar, decode, crop, tokenize, the pipe).", ""]
    header = "| shorter side (bits/pixel) | " + " | ".join(paths) + " | topoclip ÷ " + " | topoclip ÷ ".join(
        paths[1:]) + " |" + (f" workers for {gpu['images_per_s']:,.0f} img/s (topoclip, {paths[-1]}) |" if gpu else "")
    rows += [header, "|---" * (2 * len(paths) + bool(gpu)) + "|"]
    for size, entry in result["sizes"].items():
        per_worker = [entry["paths"][name]["per_worker"] for name in paths]
        ratios = [per_worker[0] / other for other in per_worker[1:]]
        cells = [f"{value:,.0f}" for value in per_worker] + [f"{ratio:.1f}×" for ratio in ratios]
        if gpu:
            workers = entry["workers_for_the_gpu_step"]
            cells.append(f"{workers[paths[0]]}, {workers[paths[-1]]}")
        rows.append(f"| {size} px ({entry['bits_per_pixel']:.1f}) | " + " | ".join(cells) + " |")
    if gpu:
        rows += ["", f"The GPU step: {gpu['preset']}, {gpu['precision']}, batch {gpu['batch']}, compiled, on random "
                     f"tensors, {gpu['images_per_s']:,.0f} img/s on an {gpu['gpu']} ({gpu['source']}); the workers "
                     f"it needs are that rate over one worker's, on cores like these."]
    return "\n".join(rows)


def csv_rows_table(result: dict) -> str:
    """benchmarks/csv_rows.py: what a CSV's rows cost a DataLoader worker, as Python strings and packed."""
    columns = ("in-process MiB", "peak while reading MiB", "copied per forked reader MiB", "pickled MiB", "pickle s",
               "unpickle s")
    rows = [f"Measured: `{result['command']}` ({result['rows']:,} rows) on {result['machine']}, torch {result['torch']}:", "",
            "| rows held as | in the process (MiB) | at most while reading (MiB) | copied by each forked worker that reads "
            "them (MiB) | pickled for a fork-server worker (MiB) | pickle (s) | unpickle (s) |", "|---|---|---|---|---|---|---|"]
    rows += [f"| {line['rows as']} | " + " | ".join(f"{line[column]:g}" for column in columns) + " |"
             for line in result["results"]]
    return "\n".join(rows)


RENDERERS = {"default-run": default_run_table, "csv-rows": csv_rows_table, "compare": compare_table, "claims": claims_table,
             "claims-summary": claims_summary_table, "headline": headline_table,
             "experts": experts_table, "equilibrium": equilibrium_table,
             "equilibrium-train": equilibrium_table, "similarities": similarities_table,
             "collapse": similarities_table, "false-negatives": false_negatives_table, "ceiling": ceiling_table,
             "ceiling-hard": ceiling_table, "hard-task-pilot": pilot_table, "tau-late-rise": tau_late_rise_table,
             "gpu-check": gpu_check_table, "fsdp-memory": fsdp_memory_table, "loader": loader_table}


def load_results(name: str):
    """docs/results/NAME.json (a grid trained in parts: `pooled`), NAME/ablation.json, or the list of NAME/*.json (one
    analysis per run, each with its file's stem added as "file")."""
    if name == "tau-late-rise":  # computed from every grid's curves
        return tau_late_rise()
    if name == "headline":  # computed from the grids of HEADLINE
        return headline_points()
    if name.startswith(LR_CHOICE):  # the pre-registered choice of each family's lr, from the grid after the prefix
        grid = name.removeprefix(LR_CHOICE)
        final = RESULTS / f"{grid}-final-validation.json"
        return {**load_results(grid), **({"final_validation": json.loads(final.read_text())} if final.is_file() else {})}
    if name == "claims-summary":
        return json.loads((RESULTS / "claims.json").read_text())
    if (RESULTS / f"{name}.json").exists():
        results = read_results(RESULTS / f"{name}.json")
        return pooled(name, results) if isinstance(results, dict) and "parts" in results else results
    if (RESULTS / name / "ablation.json").exists():
        return read_results(RESULTS / name / "ablation.json")
    runs = sorted((RESULTS / name).glob("*.json"))
    if not runs:
        raise FileNotFoundError(f"no results for block {name!r} in {RESULTS}")
    return [{**json.loads(path.read_text()), "file": path.stem} for path in runs]


# `topoclip ablate`'s options that choose which runs of a grid it trains and where, not how they train
PART_OPTIONS = ("cells", "first_seed", "seeds", "jobs", "out", "reuse", "debug")


def run_settings(command: str) -> dict:
    """How the runs of an `ablate` command line train: its options as `topoclip ablate` parses them (defaults, `--opt=v`
    and the order of --set as it reads them), less those that only choose which runs and where (PART_OPTIONS)."""
    from topoclip.cli import parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = vars(parser().parse_args(shlex.split(command)[1:]))
    except SystemExit:
        raise ValueError(f"{command!r} is not a `topoclip ablate` command line") from None
    return {key: value for key, value in args.items() if key not in PART_OPTIONS and not callable(value)}


def read_results(path: Path, root: Optional[Path] = None):
    """A results file's JSON, through topoclip's door (a regular file, inside `root` when given, bounded in size and
    depth); ValueError naming the file otherwise."""
    return read_json(path, "results file", root, error=ValueError)


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
    for file in sorted(RESULTS.glob("*.json")):
        results = read_results(file)
        if isinstance(results, dict) and "parts" in results:
            found[file.stem] = check_pool(file.stem, results)
    return found


def pooled(name: str, spec: dict) -> dict:
    """A grid trained in parts (docs/results/NAME.json: {"about", "parts": [folder, ...], "seeds"?}): `topoclip ablate`
    runs of one grid with the same settings, each into its own folder (`--cells`, `--first-seed K --seeds N`), where one
    sitting of the machine cannot train it whole. Their runs as one ablation ("runs", "steps", "grid", "parts": what a
    comparison, a convergence rule and τ's late rise read; not a grid's own table), and "unfinished": each cell with
    fewer than its "seeds" (seeds 0 to seeds − 1, the runs it was registered with) so far, which `cell_values` refuses.
    Refused: a part that is not a landed ablation folder, or listed twice; parts of other schedules, presets or
    settings (`run_settings`); a run (cell and seed) in two parts, or a seed beyond the registered ones."""
    parts, seeds = check_pool(name, spec)["parts"], spec.get("seeds")
    if not parts or len(set(parts)) < len(parts):
        raise ValueError(f"{name}.json must list its parts, each once: {parts}")
    grids = {}
    for part in parts:
        path = RESULTS / part / "ablation.json"
        grids[part] = read_results(path) if path.exists() else {}
        runs = grids[part].get("runs") if isinstance(grids[part], dict) else None
        if grids[part].get("analysis") != "ablation" or not isinstance(runs, list) or not all(
                isinstance(run, dict) and isinstance(run.get("cell"), str) and type(run.get("seed")) is int
                for run in runs):
            raise ValueError(f"{name}: part {part} is not an ablation folder of docs/results; land it first "
                             f"(python scripts/readme_results.py land OUT --pool {name})")
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
    twice = [key for key, count in Counter((run["cell"], run["seed"]) for run in runs).items() if count > 1]
    if twice:
        raise ValueError(f"{name}: {twice[0][0]} seed {twice[0][1]} is in two of its parts; a run would count twice")
    beyond = next((run for run in runs if seeds and not 0 <= run["seed"] < seeds), None)
    if beyond:
        raise ValueError(f"{name}: {beyond['part']}'s {beyond['cell']} seed {beyond['seed']} is not one of the "
                         f"{seeds} seeds registered")
    counts = Counter(run["cell"] for run in runs)
    return {"analysis": "ablation", "grid": grids[parts[0]].get("grid"), "steps": grids[parts[0]].get("steps"),
            "parts": parts, "seeds": seeds, "runs": runs,
            "unfinished": {cell: n for cell, n in counts.items() if seeds and n < seeds}}


# A block named by a spec file's suffix (docs/results/NAME-SUFFIX.json) is that kind of table.
SUFFIX_RENDERERS = {"-tests": comparison_table, "-equivalence": equivalence_table, "-retrieval": retrieval_table,
                    "-convergence": convergence_table, "-reruns": reruns_table}


def renderer_for(name: str):
    """The function that draws block NAME: the lr rule's table for lr-choice-GRID, a spec file's kind by its suffix,
    a named table (a grid's steps suffix aside), else the grid's own table."""
    if name.startswith(LR_CHOICE):
        return lr_choice_table
    suffix = next((s for s in SUFFIX_RENDERERS if name.endswith(s)), None)
    return SUFFIX_RENDERERS[suffix] if suffix else RENDERERS.get(re.sub(r"-\d+$", "", name), ablation_table)


def render_blocks(readme: str) -> str:
    """The document with every generated block rewritten from its results file."""
    def replace(match: re.Match) -> str:
        name = match.group(1)
        results = load_results(name)
        return f"<!-- results:{name} -->\n{renderer_for(name)(results)}\n<!-- /results:{name} -->"

    return re.sub(r"<!-- results:([\w-]+) -->.*?<!-- /results:\1 -->", replace, readme, flags=re.S)


def plot_grid(name: str, out: Path) -> Path:
    """OUT/curves.png of a committed grid, drawn from its ablation.json (the committed report keeps only the plots
    its pages show)."""
    from topoclip.experiments.report import plot_evaluations

    results = load_results(name)
    out.mkdir(parents=True, exist_ok=True)
    path = plot_evaluations(results["runs"], out, load_grid(results["grid"]).zero_shot_set)
    if path is None:
        raise SystemExit(f"{name}: its runs have no periodic evaluations to draw")
    return path


def record(run_dir: Path, wall_seconds: float, command: str) -> Path:
    """docs/results/default-run.json from a finished run folder."""
    import torch

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = [m for m in metrics if "t" in m][-1]
    results = {"command": command, "wall_seconds": wall_seconds, "torch": torch.__version__.split("+")[0],
               "machine": f"{platform.machine()}, {torch.get_num_threads()} threads (the 2-core development machine)",
               "temperature": f"τ = {last['scale']:.2f} (t = {last['t']:.3f})",
               "records": json.loads((run_dir / "eval.json").read_text())}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "default-run.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path


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
    if (RESULTS / f"{name}.json").is_file():  # load_results would read it, not the folder
        raise ValueError(f"docs/results/{name}.json exists and would hide docs/results/{name}/: rename {out_dir}")
    found = pools()
    other = next((other for other, spec in found.items() if name in spec["parts"] and other != pool), None)
    if other:
        raise ValueError(f"{name} is a part of {other}: land it with --pool {other}")
    if pool and pool not in found:
        raise ValueError(f"docs/results/{pool}.json is not a grid in parts ({{\"about\", \"parts\": [...]}}): write it first")
    path = RESULTS / name / "ablation.json"
    made, before = not path.parent.is_dir(), path.read_text(encoding="utf-8") if path.is_file() else None
    written = json.dumps(results, ensure_ascii=False, separators=(",", ":"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(written, encoding="utf-8")
    try:
        if pool:
            spec = found[pool]
            spec["parts"] += [name] * (name not in spec["parts"])
            pooled(pool, spec)
        if before is not None and before != written and not replace:
            raise ValueError(f"docs/results/{name}/ablation.json holds other results; land under another name (rename "
                             f"{out_dir}), or pass --replace to replace them")
        if pool:
            (RESULTS / f"{pool}.json").write_text(json.dumps(spec, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    except Exception:
        if before is not None:
            path.write_text(before, encoding="utf-8")
        else:
            path.unlink()
            if made:
                path.parent.rmdir()
        raise
    return path


def refresh(write: bool) -> int:
    """`write`: rewrite every document's generated blocks and the headline figure; else check them (1: stale)."""
    stale = []
    for document in DOCUMENTS:
        current = document.read_text()
        wanted = render_blocks(current)
        if write:
            document.write_text(wanted)
            print(f"wrote {document.relative_to(ROOT)}")
        elif wanted != current:
            stale.append(document.relative_to(ROOT))
    figure = RESULTS / "headline.png"
    if write:
        print(f"wrote {plot_headline(headline_points(), figure).relative_to(ROOT)}")
    elif drawn_from(figure) != fingerprint(headline_points()):
        stale.append(figure.relative_to(ROOT))
    if stale:
        print(f"{', '.join(map(str, stale))}: generated blocks or figure differ from docs/results/; "
              f"run: python scripts/readme_results.py write")
        return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    recorder = commands.add_parser("record", help="docs/results/default-run.json from a run folder")
    recorder.add_argument("run_dir", type=Path)
    recorder.add_argument("--wall-seconds", type=float, required=True, help="the whole command's wall time")
    recorder.add_argument("--as-command", default="topoclip train", help="the command that made the run")
    plotter = commands.add_parser("plot", help="draw a committed grid's validation curves (curves.png) into a folder")
    plotter.add_argument("grid", help="a folder of docs/results with an ablation.json, e.g. table3-lr1e-3-9600")
    plotter.add_argument("out", type=Path)
    lander = commands.add_parser("land", help="copy a finished ablation's ablation.json into docs/results/NAME/ "
                                               "(NAME: the folder's name)")
    lander.add_argument("out", type=Path, help="the --out folder of a finished `topoclip ablate`")
    lander.add_argument("--pool", help="the grid in parts (docs/results/POOL.json) this folder is a part of")
    lander.add_argument("--replace", action="store_true", help="replace docs/results/NAME when it holds other results")
    commands.add_parser("write", help="rewrite the README's generated blocks")
    commands.add_parser("check", help="exit 1 when the README's blocks differ from the results files")
    args = parser.parse_args()
    if args.command == "record":
        print(f"wrote {record(args.run_dir, args.wall_seconds, args.as_command)}")
        return 0
    if args.command == "land":
        try:
            landed = land(args.out, args.pool, args.replace)
        except (OSError, ValueError, KeyError) as error:
            print(f"land: {error}", file=sys.stderr)
            return 1
        print(f"wrote {landed.relative_to(ROOT)}" + (f", a part of {args.pool}" if args.pool else ""))
        return 0
    if args.command == "plot":
        print(f"wrote {plot_grid(args.grid, args.out)}")
        return 0
    try:
        return refresh(args.command == "write")
    except (OSError, ValueError, KeyError, TypeError) as error:  # a results file damaged, missing, or not what it
        what = f"a results file lacks {error}" if isinstance(error, KeyError) else error  # should be
        print(f"{args.command}: {what}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
