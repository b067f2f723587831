"""The tables a spec file in docs/results asks for (NAME-tests, -equivalence, -convergence, -reruns, -rerun-check,
-retrieval, -stability, the claims, each family's lr), each value recomputed from the runs: Welch's t, TOST, Holm,
prediction intervals, τ's late rise, skipped steps."""
from __future__ import annotations

import math
import os

from topoclip.experiments.statistics import format_p, holm, mean_std, paired, permutation, prediction, tost, welch
import topoclip.experiments.results.files as files
from topoclip.experiments.results.files import load_result, pooled, pools, read_results, run_settings
from topoclip.config import to_dict
from topoclip.experiments.grid import cell_config, config_differences, load_grid, select_cells
from topoclip.experiments.results.grids import CEILING_ROWS, RANK_ROWS, describe_machine, experts_values


def cell_values(source: str, cell: str, metric: str, set_name: str = "") -> list[float]:
    """Each seed's value of one metric of one cell of the results in docs/results/SOURCE.

    An ablation: metric is a Table 6 column of its runs (final_t, i2t_r1, t2i_r1, zero_shot_top1,
    linear_probe_top1, convergence_step), "tau" (exp of each run's final t), "headline:KEY" (a metric of
    each run's final evaluation) or "retrieval:SET/KEY" (any retrieval metric of it, mAP@R and R-Precision too).
    A compare: cell is "multi" or "sphere", metric a row of its table.
    The experts: cell is k, set_name the zero-shot set.
    """
    results = load_result(source)
    if source == "experts":
        return experts_values(results)[set_name][int(cell)]
    if results.get("analysis") == "compare":
        return next(row[cell]["values"] for row in results["rows"] if row["metric"] == metric)
    runs = [r for r in results["runs"] if r["cell"] == cell]
    if not runs and any(r["cell"] == cell for r in results.get("stopped", [])):
        raise ValueError(f"every run of {source}'s {cell} stopped on non-finite values: there is nothing to tabulate")
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


def stopped_of(refs) -> list[str]:
    """The runs of the cells `refs` ([source, cell] pairs) that stopped on non-finite values ("CELL seed K (SOURCE)"):
    done, not re-run, and in no table's numbers."""
    return sorted({f"{cell} seed {run['seed']} ({source})" for source, cell in refs
                   for run in load_result(source).get("stopped", []) if run["cell"] == cell})


def stopped_runs(refs) -> str:
    """A sentence naming them, which every table of those cells leaves out (its n shows it); "" when none did."""
    left = stopped_of(refs)
    return f" Left out, stopped on non-finite values: {', '.join(left)}." if left else ""


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
    {"source": ablation, "metrics": [{"metric", "label", "digits"?}], "rows": [{"label", "a", "b", "metrics"?}]},
    where a and b are cells of the source, or [ablation, cell] pairs for cells of other results; a row's "metrics"
    (the metrics' names) limits it to those, the others shown as "—" and left out of Holm's family (a primary endpoint
    tested in its own table). Bold: the 95 % interval excludes 0; †: so does Holm's adjustment over every test of the
    table. A metric with "permutation": true (values bimodal across seeds) also gets, under the table, each row's
    values seed by seed and the exact permutation p."""
    metrics = spec["metrics"]
    names = {m["metric"] for m in metrics}
    for row in spec["rows"]:
        if not set(row.get("metrics", names)) <= names or not row.get("metrics", names):
            raise ValueError(f"{row['label']}: its metrics {row['metrics']} are not among the table's {sorted(names)}")
    chosen = lambda row, metric: metric["metric"] in row.get("metrics", names)  # noqa: E731

    def sides(row: dict, metric: dict) -> tuple[list[float], list[float]]:
        a, b = (cell_values(*(ref if isinstance(ref, list) else (spec["source"], ref)), metric["metric"])
                for ref in (row["a"], row["b"]))
        return a, b

    differences = [[welch(*sides(row, metric)) if chosen(row, metric) else None for metric in metrics]
                   for row in spec["rows"]]
    tested = [d for row in differences for d in row if d and not d.unvaried]  # a fixed τ in both: nothing to test
    adjusted = iter(holm([d.p for d in tested]))  # in the order of `tested`: row by row
    kept = [[bool(d) and not d.unvaried and next(adjusted) < 0.05 for d in row] for row in differences]
    lines = [spec.get("about", ""), "", "| comparison | " + " | ".join(m["label"] for m in metrics) + " |",
             "|---|" + "---|" * len(metrics)]
    for row, row_differences, row_kept in zip(spec["rows"], differences, kept):
        cells = []
        for metric, d, holds in zip(metrics, row_differences, row_kept):
            digits = metric.get("digits", 1)
            if d is None:
                cells.append("—")
                continue
            if d.unvaried:
                cells.append(f"{d.effect:+.{digits}f} (no spread)")
                continue
            bold = "**" if d.significant else ""
            cells.append(f"{bold}{d.effect:+.{digits}f}{bold}{'†' * holds} "
                         f"({d.low:+.{digits}f} to {d.high:+.{digits}f}), {format_p(d.p)}")
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    sizes = ", ".join(f"{a} and {b}" for a, b in sorted({(d.n_a, d.n_b) for row in differences for d in row if d}))
    lines += ["", f"Each cell: the difference of means a − b, its 95 % confidence interval and the p-value of "
                  f"Welch's t; n = {sizes} runs; bold where the interval excludes 0, † where the difference stays "
                  f"significant after Holm's adjustment over the table's {len(tested)} tests "
                  f"({sum(map(sum, kept))} of the {sum(d.significant for d in tested)} bold ones)."
              + (" \"No spread\": every run of both cells gave the same value, so there is nothing to test."
                 if any(d and d.unvaried for row in differences for d in row) else "")
              + (" \"—\": not a test of this table." if any(d is None for row in differences for d in row) else "")
              + stopped_runs({tuple(ref) if isinstance(ref, list) else (spec["source"], ref)
                              for row in spec["rows"] for ref in (row["a"], row["b"])})]
    for metric in (m for m in metrics if m.get("permutation")):
        for row in (row for row in spec["rows"] if chosen(row, metric)):
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
        results = load_result(source)
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
        done = [len(values) + len(stopped_of(map(tuple, refs))) for values, refs in ((a, row["a"]), (b, row["b"]))]
        if min(done) < spec.get("seeds", 0):  # a run that stopped is done: reported, not re-run
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
                                   "Where Welch's t finds a difference, TOST says whether it is smaller than the margin."
                                   + stopped_runs({tuple(ref) for row in spec["rows"] for ref in row["a"] + row["b"]})])


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
    long, short = load_result(spec["long"]), load_result(spec["short"])
    steps = f"{long['steps']:,}" if long["steps"] else spec["long"]  # a grid in parts before its first part: no steps
    lines = [spec["about"], "", "| cell | validation mean recall, last quarter (sd) | τ, last quarter (sd) | test mean recall, "
             f"{steps} − {short['steps']:,} steps | verdict |", "|---|---|---|---|---|"]
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


# The loss scale fp16 training starts from: torch.amp.GradScaler's default init_scale, which the trainer keeps.
GRAD_SCALER_INIT = 2.0**16


def overflow_skips(loss_scale: list[float]) -> int:
    """The steps fp16's GradScaler skipped at least, from its loss scale at the logged steps (after its start,
    GRAD_SCALER_INIT): it halves the scale at every step whose gradients overflow, so each halving between two
    logged values is one skipped step (a rise between them, after 2,000 good steps, hides as many more)."""
    scales = [GRAD_SCALER_INIT, *loss_scale]
    return sum(max(0, round(math.log2(before / after))) for before, after in zip(scales, scales[1:]))


def stability_table(spec: dict) -> str:
    """Markdown: how stable each cell's runs were (docs/results/NAME-stability.json: {"about", "rows": [{"label",
    "source", "cell"}]}): the steps skipped for a non-finite loss, fp16's overflow skips (from the loss scale), τ and a
    hyperbolic model's curvature c at the end (mean ± sd over the seeds) and over the whole run (the range of every
    logged value of every seed). A run that stopped on non-finite values is counted beside the cell's runs (its grid's
    "stopped"), not in its numbers."""
    lines = [spec["about"], "", "| cell | runs | non-finite steps skipped (runs with any) | fp16 overflow skips, at least "
             "| τ at the end | τ, whole run | c at the end | c, whole run |", "|---|---|---|---|---|---|---|---|"]
    for row in spec["rows"]:
        results = load_result(row["source"])
        runs = [r for r in results["runs"] if r["cell"] == row["cell"]]
        stopped = sum(r["cell"] == row["cell"] for r in results.get("stopped", []))
        if row["cell"] in results.get("unfinished", {}) or not (runs or stopped):
            lines.append(f"| {row['label']} | {len(runs) + stopped} of {results['seeds']} so far | | | | | | |")
            continue
        count = f"{len(runs)}" + (f" (+ {stopped} stopped on non-finite values)" if stopped else "")
        if not runs:
            lines.append(f"| {row['label']} | {count} | | | | | | |")
            continue
        skipped = [r.get("skipped_steps") for r in runs]  # None: a record from before the count was kept
        scaled = [r["curve"]["loss_scale"] for r in runs if "loss_scale" in r["curve"]]
        cells = [f"{sum(skipped):,} ({sum(k > 0 for k in skipped)})" if None not in skipped else "— (not recorded)",
                 f"{sum(map(overflow_skips, scaled)):,}" if scaled else "— (not fp16)"]
        for key, digits in (("scale", 1), ("curvature", 3)):
            curves = [r["curve"][key] for r in runs if r["curve"].get(key)]
            if len(curves) < len(runs):
                cells += ["—", "—"]
                continue
            mean, sd = mean_std([curve[-1] for curve in curves])
            every = [value for curve in curves for value in curve]
            cells += [f"{mean:.{digits}f}" + (f" ± {sd:.{digits}f}" if len(curves) > 1 else " (one run)"),
                      f"{min(every):.{digits}f}–{max(every):.{digits}f}"]
        lines.append(f"| {row['label']} | {count} | " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", "τ and c as logged every few steps; a non-finite loss skips its step (the trainer's "
                                   "count); under fp16 a step whose gradients overflow is skipped too, and halves the "
                                   "loss scale, so the halvings between logged steps count those skips from below."])


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


STOPPED = "stopped on non-finite values"  # a re-run's column where it did

# What a re-run's config may differ in from its cell's runs': its seed, and where it trains (the device, and TF32, which
# only a GPU has: a re-run on a GPU must have it off, so that its matrix products are fp32 as a CPU's are).
RERUN_FREE = {"train.seed", "train.device", "train.allow_tf32"}


def kernel(machine: dict) -> str:
    """"Linux-6.18.44-fc-v595-x86_64": the platform a run trained on, its C library aside."""
    return machine["platform"].split("-with")[0]


def trained_config(results: dict, cell: str, seed: int) -> dict:
    """The config (to_dict) one run of an ablation trained with, resolved from its recorded command as `topoclip
    ablate` resolves it (topoclip.experiments.runner.ablate: --steps last), with today's presets and grids."""
    settings = run_settings(results["command"])
    grid = load_grid(settings["grid"])
    (levels,) = select_cells(grid, [cell])
    overrides = settings["overrides"] + ([f"train.steps={settings['steps']}"] if settings["steps"] is not None else [])
    return to_dict(cell_config(grid, levels, overrides, seed, settings["preset"]))


def changed_settings(registered: dict, config: dict) -> list[str]:
    """The settings of a registered config (to_dict) that `config` has otherwise: those added to the schema since
    (defaults that keep what the runs trained with: grid.saved_settings) aside."""
    def leaves(node, prefix=""):
        return [leaf for key, value in node.items() for leaf in leaves(value, f"{prefix}{key}.")] \
            if isinstance(node, dict) else [prefix.rstrip(".")]

    known = leaves(registered)
    return sorted(path for path in config_differences(registered, config)
                  if any(leaf == path or leaf.startswith(path + ".") for leaf in known))


def rerun_refusal(results: dict, cell: str, spec: dict, own: dict, kernels: set) -> str:
    """Why a landed re-run (its ablation's results) does not count as spec["seed"] of `cell` trained on another machine
    with the config `own` of the cell's runs (trained_config) and the code spec["code_sha256"], the cell's runs'
    kernels being `kernels`; "" when it counts. The pinned code records no digest (code_info came later): a re-run
    without one is taken for it."""
    landed = results.get("runs", []) + results.get("stopped", [])
    if len(landed) != 1:
        return f"holds {len(landed)} runs, not one (`--seeds 1`)"
    if (landed[0]["cell"], landed[0]["seed"]) != (cell, spec["seed"]):
        return f"is {landed[0]['cell']} seed {landed[0]['seed']}, not the registered {cell} seed {spec['seed']}"
    if landed[0].get("reused_from") or results.get("trained_now") == 0:
        return "not trained by the call that tabulated it (copied with --reuse, or tabulated again later)"
    machine = results.get("machine") or {}
    if not machine.get("platform"):
        return "its results record no machine"
    code = (results.get("code") or {}).get("sha256")
    if code and code != spec["code_sha256"]:
        return f"trained with other code than the pinned (its files' sha256 {code[:12]}…)"
    config = trained_config(results, cell, spec["seed"])
    differences = sorted(set(config_differences(config, own)) - RERUN_FREE)
    if differences:
        return f"trained otherwise than the cell's runs ({', '.join(differences[:3])}{', …' * (len(differences) > 3)})"
    if machine.get("cuda") and config["train"]["device"] != "cpu" and config["train"]["allow_tf32"]:
        return "trained on a GPU with TF32 on (--set train.allow_tf32=false)"
    if kernel(machine) in kernels:
        return f"{kernel(machine)} is a machine the cell's runs trained on"
    return ""


def rerun_check_table(spec: dict) -> str:
    """Markdown: a re-run on another machine read against the prediction intervals it was registered with
    (docs/results/NAME-rerun-check.json: {"about", "reruns": the -reruns spec, "seed", "decides": the metric whose
    interval decides, "config": the cell's config as registered (trained_config), "code_sha256": the pinned
    code's (topoclip.experiments.runner.package_digest), "runs": [{"label", "source"}]}): each metric's interval,
    each landed re-run's value inside it or not, and a verdict (rerun_refusal: what counts). One that stopped on
    non-finite values fails; one that does not count, or whose results cannot be read, says why in its column; one not
    yet landed shows as such. Refused: a spec whose cell today's presets and grids resolve otherwise than registered."""
    reruns = read_results(files.RESULTS / f"{spec['reruns']}.json")
    cells, source, metrics = reruns["cells"], reruns["source"], reruns["metrics"]
    if len(cells) != 1 or spec["decides"] not in [m["metric"] for m in metrics]:
        raise ValueError(f"{spec['reruns']} must name one cell, and {spec['decides']!r} one of its metrics")
    cell = cells[0]
    cell_runs = [r for r in load_result(source)["runs"] if r["cell"] == cell]
    # the parts of a grid trained in parts (each run's own folder) have one recipe: `pooled` refuses them otherwise
    grids = [load_result(part) for part in sorted({r.get("part", source) for r in cell_runs})]
    kernels = {kernel(grid["machine"]) for grid in grids}
    own = trained_config(grids[0], cell, spec["seed"])
    changed = changed_settings(spec["config"], own)
    if changed:  # a preset or grid changed since: the runs would be compared with what they did not train with
        raise ValueError(f"today's presets and grids resolve {source}'s {cell} otherwise than when its re-run check "
                         f"was registered ({', '.join(changed[:3])}): read it with the code of then")
    intervals = {}  # metric: (mean, low, high), the prediction interval cut to the metric's bounds
    for metric in metrics:
        p = prediction(cell_values(source, cell, metric["metric"]))
        low, high = metric.get("bounds", (-math.inf, math.inf))
        intervals[metric["metric"]] = p.mean, max(p.low, low), min(p.high, high)

    def inside(values, metric: str) -> bool:  # the unrounded value: the verdict is never the display's rounding
        _, low, high = intervals[metric]
        return isinstance(values, dict) and low <= values[metric] <= high

    digits = {m["metric"]: m.get("digits", 1) + 1 for m in metrics}  # one more than the -reruns table's
    columns = []  # (label, what each metric's cell shows, verdict)
    for run in spec["runs"]:
        try:
            results = load_result(run["source"])
        except FileNotFoundError:
            columns.append((run["label"], {m: "not run yet" for m in intervals}, "—"))
            continue
        try:
            finished = results.get("runs", [])
            values = ({m: cell_values(run["source"], cell, m)[0] for m in intervals}
                      if len(finished) == 1 and finished[0]["cell"] == cell else None)
            stopped = not finished and [r["cell"] for r in results.get("stopped", [])] == [cell]
            refusal = rerun_refusal(results, cell, spec, own, kernels)
            machine = results.get("machine") or {}
            label = f"{run['label']}: {describe_machine(machine)}" if machine.get("platform") else run["label"]
        except (AttributeError, KeyError, TypeError, ValueError) as error:  # a damaged or foreign results file
            columns.append((run["label"], {m: "—" for m in intervals},
                            f"does not count: {run['source']}'s results cannot be read ({type(error).__name__}: {error})"))
            continue
        shown = {m: f"{values[m]:.{digits[m]}f} " + ("inside" if inside(values, m) else "**outside**") if values
                 else STOPPED if stopped else "—" for m in intervals}
        held = sum(inside(values, m) for m in intervals)
        columns.append((label, shown, f"does not count: {refusal}" if refusal else
                        f"**{'passes' if inside(values, spec['decides']) else 'fails'}** ({held} of {len(intervals)} inside)"))

    lines = [spec["about"], "", "| metric | one more seed lands in | " + " | ".join(c[0] for c in columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    for metric in metrics:
        key = metric["metric"]
        (mean, low, high), shown_digits = intervals[key], digits[key]
        lines.append(f"| {metric['label']}{' (decides)' * (key == spec['decides'])} | {mean:.{shown_digits}f} "
                     f"({low:.{shown_digits}f} to {high:.{shown_digits}f}) | " + " | ".join(c[1][key] for c in columns) + " |")
    lines.append("| verdict | | " + " | ".join(c[2] for c in columns) + " |")
    return "\n".join(lines + ["", f"The interval: the mean of {source}'s {len(cell_runs)} runs of {cell} and the 95 % "
                                   f"prediction interval for one more run ({spec['reruns']}), on "
                                   + "; ".join(sorted({describe_machine(grid["machine"]) for grid in grids}))
                                   + ". A re-run passes when the metric that decides lands inside its interval; a miss "
                                   f"among the other {len(intervals) - 1} is reported, not failed."])


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


def retrieval_table(spec: dict) -> str:
    """Markdown: every retrieval metric of some cells (mean ± sd over seeds) beside the ceiling of each
    (docs/results/NAME-retrieval.json: {"about", "ceiling": results name, "set", "cells": [{"label", "source", "cell"}]})."""
    ceiling = load_result(spec["ceiling"])["ceiling"]["this_set"]
    lines = [spec["about"], "", "| metric | ceiling | " + " | ".join(c["label"] for c in spec["cells"]) + " |",
             "|---|---|" + "---|" * len(spec["cells"])]
    for label, key in CEILING_ROWS + RANK_ROWS:
        values = [mean_std(cell_values(c["source"], c["cell"], f"retrieval:{spec['set']}/{key}")) for c in spec["cells"]]
        bound = f"{ceiling[key]:.1f}" if key in ceiling else "—"
        lines.append(f"| {label} | {bound} | " + " | ".join(f"{m:.1f} ± {sd:.1f}" for m, sd in values) + " |")
    return "\n".join(lines + ["", f"Each cell: mean ± sd over its seeds, on {spec['set']}. The ceiling is the Bayes-optimal "
                                   "ranking's on the same set (`topoclip data ceiling`); mAP@R and R-Precision count every "
                                   "true caption, so the paired-caption ceiling does not bound them and none is given."])


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
    """{family: the cell the pre-registered rule picks} of an lr grid whose cells are FAMILY_lr-LR; refused for a grid
    in parts (`pooled`) with a cell still short of its seeds (the rule reads whole cells)."""
    if results.get("unfinished"):
        cell, count = next(iter(results["unfinished"].items()))
        raise ValueError(f"{cell} has {count} of its {results['seeds']} seeds so far: the lr rule waits for every cell")
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
    grids = {folder.name: read_results(files.results_file(folder, "ablation.json"))
             for folder in files.listed(files.RESULTS, folders=True)
             if files.results_file(folder, "ablation.json").is_file()}
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
