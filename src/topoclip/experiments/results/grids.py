"""A grid's own tables (what `ablate` and `compare` wrote, the analyses of its runs), the default run's and the
ceiling's."""
from __future__ import annotations

import math
from pathlib import Path

from topoclip.experiments.compare import MODELS, comparison_rows, markdown as compare_markdown
from topoclip.experiments.grid import load_grid
from topoclip.experiments.report import markdown_table
from topoclip.experiments.statistics import mean_std
from topoclip.experiments.results.files import load_result


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
            + compare_markdown(comparison_rows(values), len(results["seeds"]), results["steps"], results.get("models")))


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


def hierarchy_table(runs: list[dict]) -> str:
    """Markdown: `topoclip analyze hierarchy` over the seeds of each cell (files CELL-seed-K.json): how often the generic
    caption of a pair lies nearer the origin, the trained model beside an untrained one of the same config, with the
    Wilson interval of every seed's pairs pooled; how often the image lies beyond its most specific caption; and the
    traversal's mean retrieved level from the image (s = 1) to the origin (s = 0). Mean ± sd over the seeds. Runs
    measured on other scenes, levels or traversal steps are refused (their numbers would share a column)."""
    from topoclip.analysis.hierarchy import wilson

    first = runs[0]
    shape = (first["size"], first["levels"], [point["s"] for point in first["trained"]["traversal"]])
    for run in runs:
        if (run["size"], run["levels"], [point["s"] for point in run["trained"]["traversal"]]) != shape:
            raise ValueError(f"{run['file']} was measured on other test scenes, levels or traversal steps than "
                             f"{first['file']}; run `topoclip analyze hierarchy` on both alike")
    cells: dict[str, list[dict]] = {}
    for run in runs:
        cells.setdefault(run["file"].rsplit("-seed-", 1)[0], []).append(run)

    def spread(values) -> str:
        mean, sd = mean_std(list(values))
        return f"{mean:.2f} ± {sd:.2f}"

    def pooled(chosen: list[dict]) -> str:  # every pair of levels of every chain of every seed, one trial each
        pairs = [pair for run in chosen for pair in run["trained"]["generic_nearer"]["pairs"].values()]
        successes, trials = sum(round(p["fraction"] * p["trials"]) for p in pairs), sum(p["trials"] for p in pairs)
        low, high = wilson(successes, trials)
        return f"{successes / trials:.3f} ({low:.3f}–{high:.3f})"

    traversal = f" (the first {first['traversal_images']} images)" if "traversal_images" in first else ""
    lines = [f"{first['size']} test scenes a run, each a chain of {len(first['levels'])} captions from the generic "
             f"({first['levels'][0]}) to the specific ({first['levels'][-1]}); mean ± sd over the seeds.", "",
             "| cell | runs | generic nearer the origin, trained | untrained | trained, pairs pooled (Wilson 95 %) "
             "| image beyond its most specific caption |", "|---|---|---|---|---|---|"]
    for cell, chosen in cells.items():
        lines.append(f"| {cell} | {len(chosen)} | " + " | ".join(
            spread(run[model]["generic_nearer"]["all"]["mean"] for run in chosen) for model in ("trained", "untrained"))
            + f" | {pooled(chosen)} | {spread(run['trained']['image_beyond_captions']['fraction'] for run in chosen)} |")
    lines += ["", "Pooled: the pairs of one chain share its captions, so this interval is narrower than one over the "
                  "chains (each run's file has that one, and a Wilson interval per pair of levels).", "",
              f"The traversal from each image towards the origin (x_s = exp₀(s·log₀ x)){traversal}: the mean level of "
              f"the nearest caption (0 generic … 4 specific), trained models, mean over the seeds.", "",
              "| cell | " + " | ".join(f"s = {s:.1f}" for s in shape[2]) + " |", "|---|" + "---|" * len(shape[2])]
    for cell, chosen in cells.items():
        levels = [mean_std([run["trained"]["traversal"][k]["mean_level"] for run in chosen])[0]
                  for k in range(len(shape[2]))]
        lines.append(f"| {cell} | " + " | ".join(f"{level:.2f}" for level in levels) + " |")
    return "\n".join(lines)


def curvature_pull_table(result: dict) -> str:
    """Markdown: what holds each hyperbolic cell's curvature at the end (scripts/curvature_pull.py): c beside its
    clamp's floor, the loss's two parts, the share of images outside their caption's cone, and each part's derivative
    in log c, mean ± sd over the seeds; a positive derivative pulls c down (gradient descent lowers log c)."""
    cells: dict[tuple[str, int], list[dict]] = {}
    for run in result["runs"]:
        cells.setdefault((run["cell"], run["step"]), []).append(run)
    several = len({step for _, step in cells}) > 1

    def spread(values, digits: str) -> str:
        mean, sd = mean_std(list(values))
        return f"{mean:{digits}} ± {sd:{digits.lstrip('+')}}"

    lines = [f"Each run's last checkpoint on its first {result['batches']} training batches (`{result['command']}`); "
             "mean ± sd over the seeds. ∂/∂log c > 0: the part pulls c down, towards a flatter space.", "",
             "| cell | runs | weight | c (floor) | contrastive part | entailment loss, unweighted | images outside the "
             "cone | ∂ contrastive/∂log c | weight · ∂ entailment/∂log c |", "|---|---|---|---|---|---|---|---|---|"]
    for (cell, step), runs in cells.items():
        weights, floors = {run["weight"] for run in runs}, {round(run["c_floor"], 6) for run in runs}
        if len(weights) > 1 or len(floors) > 1:
            raise ValueError(f"{cell}: its runs differ in the entailment weight or the curvature's floor")
        if len({run["seed"] for run in runs}) < len(runs):
            raise ValueError(f"{cell}: a seed appears twice")
        weight = weights.pop()
        label = f"{cell}, {step:,} steps" if several else cell
        lines.append(f"| {label} | {len(runs)} | {weight:g} | {spread((r['c'] for r in runs), '.3f')} ({floors.pop():g}) | "
                     f"{spread((r['contrastive'] for r in runs), '.3f')} | {spread((r['entailment'] for r in runs), '.4f')} | "
                     f"{spread((100 * r['outside'] for r in runs), '.1f')} % | "
                     f"{spread((r['contrastive_pull'] for r in runs), '+.1e')} | "
                     + (spread((weight * r['entailment_pull'] for r in runs), '+.1e') if weight else "— (not trained)")
                     + " |")
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


def plot_grid(name: str, out: Path) -> Path:
    """OUT/curves.png of a committed grid, drawn from its ablation.json (the committed report keeps only the plots
    its pages show)."""
    from topoclip.experiments.report import plot_evaluations

    results = load_result(name)
    out.mkdir(parents=True, exist_ok=True)
    path = plot_evaluations(results["runs"], out, load_grid(results["grid"]).zero_shot_set)
    if path is None:
        raise SystemExit(f"{name}: its runs have no periodic evaluations to draw")
    return path
