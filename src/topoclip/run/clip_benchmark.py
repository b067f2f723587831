"""CLIP_benchmark, both ways: its result files from `topoclip eval --output`, and CLIP_benchmark itself run
on a topoclip model (`topoclip benchmark RUN -- …`).

Result files are CLIP_benchmark's (``clip_benchmark/cli.py``, ``run``): one JSON object per dataset and
task, ``{"dataset", "model", "pretrained", "task", "metrics", "language"}``, named
``{dataset}_{pretrained}_{model}_{language}_{task}.json`` (the dataset without its "wds/" prefix and
with "/" written "_", the pretrained part its base name), metrics as fractions: ``acc1``, ``acc5`` (NaN under 5 classes),
``mean_per_class_recall`` for classification; ``image_retrieval_recall@k`` and
``text_retrieval_recall@k`` for k = 1, 5, 10 for retrieval. `clip_benchmark build DIR` tabulates them.

Inside CLIP_benchmark a model is (model, transform, tokenizer) with (B, d) features that it
normalises and ranks by their inner product. A topoclip model gives (B, m, n) points; their flat
(B, m·n) form (topoclip.core.geometry.flatten) has the model's similarity as its inner product for
"sphere" and "ps-inner" (CLIP_benchmark's normalisation divides every vector by the same √m: the
ranking is unchanged). "ps-geodesic" and "euclidean" have no such form and are refused in one line.
Zero-shot classification with several templates then averages as the "flat" template mode does.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from topoclip.core.errors import UserError, check_file_name
from topoclip.core.geometry import require_flat

LANGUAGE = "en"
RECALL_KS = (1, 5, 10)
MODEL_TYPE = "topoclip"  # CLIP_benchmark's --model_type for topoclip runs


def output_name(dataset: str, pretrained: str, model: str, task: str, language: str = LANGUAGE) -> str:
    """CLIP_benchmark's default output file name for one result; UserError when the model name (or any part)
    would make it leave the output folder or not be a file name."""
    name = f"{dataset.removeprefix('wds/').replace('/', '_')}_{Path(pretrained).name}_{model}_{language}_{task}.json"
    return check_file_name(name, "the result file name", f"give a model name of plain text (--name; it was {model!r:.60})")


def clip_benchmark_metrics(record: dict) -> dict:
    """A topoclip evaluation record's metrics in CLIP_benchmark's names and units (fractions)."""
    metrics = record["metrics"]
    if record["task"] == "zeroshot_classification":
        return {"acc1": metrics["top1"] / 100,
                "acc5": metrics["top5"] / 100 if metrics.get("classes", 5) >= 5 else float("nan"),
                "mean_per_class_recall": metrics["mean_per_class_recall"] / 100}
    return {f"{direction}_retrieval_recall@{k}": metrics[f"{direction}_retrieval_recall@{k}"] / 100
            for k in RECALL_KS for direction in ("image", "text")}


def write_results(records: Sequence[dict], out_dir, model: str, pretrained: str, template_mode: str) -> list[Path]:
    """One CLIP_benchmark result file per dataset and task in `out_dir`; classification from `template_mode`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for record in records:
        if record["task"] == "zeroshot_classification" and record["metrics"].get("mode") != template_mode:
            continue
        dump = {"dataset": record["dataset"], "model": model, "pretrained": pretrained, "task": record["task"],
                "metrics": clip_benchmark_metrics(record), "language": LANGUAGE}
        path = out_dir / output_name(record["dataset"], pretrained, model, record["task"])
        path.write_text(json.dumps(dump))  # as CLIP_benchmark's json.dump: NaN written as NaN
        written.append(path)
    return written


def default_template_mode(topology: str) -> str:
    """CLIP_benchmark's own averaging ("flat") where the topology has a flat form, else the paper's."""
    from topoclip.core.geometry import get_topology

    return "distance" if get_topology(topology).not_flat else "flat"


# --------------------------------------------------------------------------- CLIP_benchmark running topoclip


class FlatFeatures(torch.nn.Module):
    """A topoclip CLIP seen as CLIP_benchmark expects: encode_image / encode_text -> (B, m·n) flat features."""

    def __init__(self, model):
        super().__init__()
        try:
            require_flat(model.config.topology)
        except ValueError as error:
            raise UserError(f"CLIP_benchmark ranks by the inner product of (B, d) features; {error}") from None
        self.model = model

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return self.model.encode_image(images, flat=True)

    def encode_text(self, text) -> torch.Tensor:
        return self.model.encode_text(text, flat=True)


def load_topoclip(model_name: str = "", pretrained: str = "", cache_dir: Optional[str] = None, device="cpu"):
    """CLIP_benchmark's loader contract: (model, transform, tokenizer) for the run or checkpoint `pretrained`."""
    from topoclip.core.errors import resolve_device
    from topoclip.run.inference import load_folder

    loaded = load_folder(Path(pretrained), resolve_device(str(device)))
    if loaded.tokenizer is None:
        raise UserError(f"{pretrained} has no tokenizer.json; CLIP_benchmark needs one to encode prompts")
    return FlatFeatures(loaded.model).eval(), loaded.transform, loaded.tokenizer


def register() -> None:
    """Adds "topoclip" to CLIP_benchmark's model types (its parser reads the same list when it runs)."""
    try:
        from clip_benchmark import models
    except ImportError:
        raise UserError("CLIP_benchmark is not installed: pip install clip_benchmark (it needs torchvision, so the "
                        "CUDA build of torch; see the README's benchmark section)") from None
    models.TYPE2FUNC[MODEL_TYPE] = load_topoclip
    if MODEL_TYPE not in models.MODEL_TYPES:
        models.MODEL_TYPES.append(MODEL_TYPE)


def benchmark_datasets(entries: Sequence[str]) -> list[str]:
    """The datasets CLIP_benchmark's --dataset values name, expanded as its main_eval does: a file of names (one a
    line; read through the door), a collection, or a name."""
    from clip_benchmark.datasets.builder import dataset_collection

    from topoclip.core.door import is_regular, read_text

    names = []
    for entry in entries:
        if is_regular(entry):
            names += [line.strip() for line in read_text(entry, "CLIP_benchmark dataset list").splitlines()
                      if line.strip()]
        else:
            names += dataset_collection.get(entry, [entry])
    return names


def workers_for_shards(cli) -> list[str]:
    """["--num_workers", K] when CLIP_benchmark's eval arguments in sys.argv ask for more loader workers (its
    default is 4) than a local WebDataset set they name has shards: CLIP_benchmark's WebDataset has no node
    splitter, so each worker takes its share of the shards, and webdataset ≥ 1 stops a worker left without one
    ("No samples found in dataset; perhaps you have fewer shards than workers"). A set's missing or bad
    nshards.txt is one line here too (CLIP_benchmark's own reading of it is a traceback)."""
    from topoclip.data.benchmark_sets import wds_shard_count

    _, base = cli.get_parser_args()
    if getattr(base, "which", None) != "eval":
        return []
    fewest = None
    for name in benchmark_datasets(base.dataset):
        if not name.startswith("wds/"):
            continue
        cleaned = name.replace("wds/", "", 1)  # as CLIP_benchmark's run() fills --dataset_root's template
        try:
            root = base.dataset_root.format(dataset=cleaned, dataset_cleaned=cleaned.replace("/", "-"))
        except (KeyError, IndexError, ValueError, AttributeError, TypeError) as error:  # what str.format raises
            raise UserError(f"--dataset_root {base.dataset_root!r:.80}: CLIP_benchmark fills in {{dataset}} and "
                            f"{{dataset_cleaned}} only ({type(error).__name__}: {error})") from None
        if "://" in root:
            continue
        try:
            shards = wds_shard_count(Path(root), base.split)
        except ValueError as error:
            raise UserError(f"{name}: {error} (CLIP_benchmark's --dataset_root names the folder; "
                            f"clip_benchmark_export_wds writes one)") from None
        fewest = shards if fewest is None else min(fewest, shards)
    if fewest is None or base.num_workers <= fewest:
        return []
    print(f"topoclip: note: --num_workers {fewest} (was {base.num_workers}): a set has {fewest} shard(s) in "
          f"{base.split!r}, and webdataset stops a loader worker that has none", file=sys.stderr)
    return ["--num_workers", str(fewest)]


def run_clip_benchmark(run, arguments: Sequence[str], model_name: str) -> int:
    """`clip_benchmark eval --model_type topoclip --model NAME --pretrained RUN ARGUMENTS…`, in this process.

    Output files are named as `topoclip eval --output` names them (the run folder's base name as the
    pretrained part), unless ARGUMENTS give --output.
    """
    register()
    from clip_benchmark import cli

    checkpoint = Path(run)
    if not checkpoint.exists():
        raise FileNotFoundError(f"{run}: no such run or checkpoint folder")
    for option in ("--model_type", "--model", "--pretrained", "--pretrained_model"):
        if option in arguments:
            raise UserError(f"{option} is set by `topoclip benchmark` (the run is the model); leave it out")
    argv = ["clip_benchmark", "eval", "--model_type", MODEL_TYPE, "--model", model_name, "--pretrained", str(run)]
    if "--output" not in arguments:
        argv += ["--output", "{dataset}_" + checkpoint.name + "_{model}_{language}_{task}.json"]
    saved, sys.argv = sys.argv, argv + list(arguments)
    try:
        sys.argv += workers_for_shards(cli)
        cli.main()
    except TypeError as error:
        if "0-dimensional arrays" not in str(error):
            raise
        # clip_benchmark 1.6.2's accuracy() calls float() on a 1-element array, which NumPy 2.4 refuses
        # (LAION-AI/CLIP_benchmark#147, open): its classification needs NumPy < 2.4.
        import numpy

        raise UserError(f"CLIP_benchmark's zero-shot classification fails under NumPy {numpy.__version__} (its "
                        f"accuracy() takes float() of an array; LAION-AI/CLIP_benchmark#147): pip install "
                        f"'numpy<2.4' in this environment") from None
    finally:
        sys.argv = saved
    return 0

