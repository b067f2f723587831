"""Evaluate a model on the sets its config names: zero-shot classification and retrieval records.

`evaluate(model, tokenizer, config)` returns CLIP_benchmark-style records
``{"dataset", "model", "task", "metrics"}``, one per (set, template mode) for classification and one
per retrieval set. The built-in scenes give shape / colour / composition sets (and out-of-domain
copies) plus a retrieval set with attribute-level relevance; the user's class folders and
Karpathy caption files are added from `config.evaluate`.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional


from topoclip.config import Config
from topoclip.data.types import ClassificationSet, RetrievalSet
from topoclip.core.errors import EvaluationSetError, UserError
from topoclip.run.evaluation.retrieval import evaluate_retrieval
from topoclip.run.evaluation.zeroshot import evaluate_classification_modes, record
from topoclip.preprocess.transforms import eval_transform


def evaluation_sets(config: Config, split: str = "test") -> tuple[list[ClassificationSet], list[RetrievalSet]]:
    """The classification and retrieval sets of `config`: the data source's own (the built-in scenes bring
    theirs), then the user's evaluate.classification / evaluate.retrieval."""
    from topoclip.data.sources import get_source

    user_classification, user_retrieval = user_evaluation_sets(config, split)  # first: a broken one fails fast
    classification, retrieval = get_source(config.data.source).evaluation_sets(config, split)
    return classification + user_classification, retrieval + user_retrieval


def user_evaluation_sets(config: Config, split: str = "test") -> tuple[list[ClassificationSet], list[RetrievalSet]]:
    """The sets named by evaluate.classification / evaluate.retrieval (cheap: files are listed, not decoded).

    EvaluationSetError (one line) for a set that cannot be scored: no class folders, no readable
    image, a malformed caption file, or a single class (which would score 100 % trivially).
    """
    settings = config.evaluate
    classification: list[ClassificationSet] = []
    retrieval: list[RetrievalSet] = []
    if not (settings.classification or settings.retrieval):
        return classification, retrieval
    from topoclip.data.benchmark_sets import is_wds_folder, load_wds_set
    from topoclip.data.folders import CAPTION_TABLE_SUFFIXES, load_caption_table, load_karpathy_captions
    from topoclip.run.evaluation.benchmarks import load_classification_entry

    for entry in settings.classification:
        try:
            dataset = load_classification_entry(entry, split)
        except (ValueError, FileNotFoundError) as error:  # the loaders' messages name the file and what is wrong
            raise EvaluationSetError(f"evaluate.classification: {error}") from None
        if isinstance(dataset, RetrievalSet):  # a CLIP_benchmark folder whose dataset_type.txt says retrieval
            retrieval.append(dataset)
            continue
        if len(dataset.classnames) < 2:
            raise EvaluationSetError(f"evaluate.classification: {entry} has one class ({dataset.classnames[0]!r}); "
                                     f"zero-shot classification needs at least 2 classes (one class scores "
                                     f"100 % whatever the model)")
        classification.append(dataset)
    data = config.data  # a caption table's columns and separator are the training table's settings
    for path in settings.retrieval:
        try:
            if is_wds_folder(path):
                retrieval.append(load_wds_set(path, split))
            elif Path(path).suffix.lower() in CAPTION_TABLE_SUFFIXES:  # the whole table, whatever the split
                retrieval.append(load_caption_table(path, data.csv_image_key, data.csv_caption_key,
                                                    data.csv_separator or None,
                                                    allow_outside=data.csv_allow_outside_paths))
            else:
                retrieval.append(load_karpathy_captions(path, Path(path).parent, split))
        except (ValueError, FileNotFoundError) as error:
            raise EvaluationSetError(f"evaluate.retrieval: {error}") from None
    return classification, retrieval


def no_evaluation_sets(config: Config) -> str:
    """Why `config` has nothing to evaluate on, and how to add a set (one line)."""
    return (f"no evaluation sets: data.source={config.data.source} has no built-in ones and evaluate.classification / "
            f"evaluate.retrieval name none; add one, e.g. --set evaluate.classification='[\"path/to/class/folders\"]'")


def evaluate(model, tokenizer, config: Config, split: str = "test", device="cpu",
             model_name: Optional[str] = None, sets: Optional[tuple[list, list]] = None) -> list[dict]:
    """Every evaluation record of `config` for `model` (already on `device`). Under torch.distributed call it on
    every rank: each embeds its share of the images and all get every record (zeroshot.image_embedding_batches).

    sets: (classification, retrieval) from `evaluation_sets(config, split)`, when already built.
    """
    vision = model.config.vision
    transform = eval_transform(vision.image_size, vision.mean, vision.std, resize=vision.eval_resize)
    name = model_name or config.name or "topoclip"
    batch_size, workers = config.evaluate.batch_size, config.evaluate.num_workers
    classification, retrieval = sets if sets is not None else evaluation_sets(config, split)
    records = []
    for dataset in classification:  # the images are encoded once for every template mode
        for metrics in evaluate_classification_modes(model, tokenizer, dataset, transform,
                                                     config.evaluate.template_modes, batch_size, device, workers):
            metrics["classes"] = len(dataset.classnames)
            records.append(record(dataset.name, name, "zeroshot_classification", metrics, dataset.domain))
    for dataset in retrieval:
        metrics = evaluate_retrieval(model, tokenizer, dataset, transform, batch_size, device=device, workers=workers)
        records.append(record(dataset.name, name, "zeroshot_retrieval", metrics, dataset.domain))
    return records


TABLE_COLUMNS = ["dataset", "domain", "task", "mode", "top1/R@1", "top5/R@5", "mean", "chance top1"]


def table_rows(records: list[dict]) -> tuple[list[list], list[str]]:
    """(rows, columns) of each record's headline numbers, with its domain and chance level.

    Classification: top-1 / top-5 / mean per-class recall, chance = 100 / classes (None when unknown).
    Retrieval: R@1 / R@5 averaged over both directions, and the mean recall (R@1, R@5, R@10 of both).
    """
    rows = []
    for item in records:
        metrics = item["metrics"]
        if item["task"] == "zeroshot_classification":
            chance = 100 / metrics["classes"] if metrics.get("classes") else None
            rows.append([item["dataset"], item.get("domain") or "user", "classification", metrics.get("mode", ""),
                         metrics["top1"], metrics["top5"], metrics["mean_per_class_recall"], chance])
        else:
            r1 = (metrics["image_retrieval_recall@1"] + metrics["text_retrieval_recall@1"]) / 2
            r5 = (metrics["image_retrieval_recall@5"] + metrics["text_retrieval_recall@5"]) / 2
            rows.append([item["dataset"], item.get("domain") or "user", "retrieval", "", r1, r5,
                         metrics["mean_recall"], None])
    return rows, TABLE_COLUMNS


def summary_table(records: list[dict]) -> str:
    """`table_rows` as fixed-width text."""
    rows, columns = table_rows(records)
    widths = [28, 24, 15, 10, 9, 9, 7, 11]
    lines = [" ".join(f"{name:<{w}}" if i < 4 else f"{name:>{w}}" for i, (name, w) in enumerate(zip(columns, widths)))]
    for row in rows:
        cells = [f"{cell:<{w}}" for cell, w in zip(row[:4], widths)]
        cells += [f"{cell:>{w}.1f}" for cell, w in zip(row[4:7], widths[4:7])]
        cells.append(f"{row[7]:>{widths[7]}.1f}" if row[7] is not None else f"{'':>{widths[7]}}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def temperature_summary(model) -> str:
    """One line: final τ and t, and the effective logit range τ·(s_max − s_min)/2 of the model's topology."""
    from topoclip.core.geometry import get_topology

    topology, m = get_topology(model.config.topology), model.config.sphere_count
    low, high = topology.similarity_range(m)
    scale = float(model.temperature.scale.detach())
    text = f"τ = {scale:.2f} (t = {float(model.temperature.t.detach()):.3f}); {model.config.topology} similarity in "
    if math.isinf(low):
        return text + f"({low:g}, {high:g}]: logits τ·s are unbounded below"
    return text + f"[{low:.2f}, {high:.2f}], so logits τ·s span ±{scale * topology.half_range(m):.1f} around their middle"


# The numbers each record of eval.json must have (what `headline` and `table_rows` read).
RECORD_METRICS = {"zeroshot_classification": ("top1", "top5", "mean_per_class_recall"),
                  "zeroshot_retrieval": ("image_retrieval_recall@1", "text_retrieval_recall@1", "image_retrieval_recall@5",
                                         "text_retrieval_recall@5", "mean_recall")}


def read_evaluation(path, root=None) -> list[dict]:
    """The records of an eval.json (inside `root`, the folder it came in, when given), checked to be what `evaluate`
    writes; UserError naming the file otherwise."""
    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    from topoclip.core.door import read_json

    try:
        records = read_json(path, "evaluation", root, error=ValueError)
    except ValueError:  # not JSON, not UTF-8, nested too deeply, an integer of 4,300+ digits, a FIFO, too large
        records = None
    good = isinstance(records, list) and all(
        isinstance(item, dict) and isinstance(item.get("dataset"), str) and item.get("task") in RECORD_METRICS
        and isinstance(item.get("metrics"), dict) and all(number(item["metrics"].get(key))
                                                           for key in RECORD_METRICS[item["task"]])
        for item in records)
    if not good:
        raise UserError(f"{path} is damaged (not the list of evaluation records topoclip writes); delete it and run "
                        f"`topoclip train --resume` on its run to evaluate again")
    return records


def headline(records: list[dict]) -> dict[str, float]:
    """Flat {"<dataset>/<metric>": value} of the headline numbers (for metrics.jsonl and plots)."""
    flat = {}
    for item in records:
        metrics = item["metrics"]
        if item["task"] == "zeroshot_classification":
            flat[f"{item['dataset']}/{metrics.get('mode', '')}/top1"] = metrics["top1"]
        else:
            flat[f"{item['dataset']}/mean_recall"] = metrics["mean_recall"]
    return flat
