"""The mixture-of-experts test (paper Table 10): zero-shot accuracy from subsets of the sub-spheres.

A product-sphere embedding has m sub-spheres (one per class token in Multi(n, m)). Scoring with
only a subset S of them — s_S(u, v) = the topology's similarity of the rows in S (for ps-inner
Σ_{k∈S} u_kᵀv_k) — tests whether each sub-sphere aligns on its own. For k = 1, 2, 4, …, m the
test draws random k-subsets (every subset when there are no more than `draws` of them) and reports
the top-1 zero-shot accuracy as mean ± std over the draws, on the built-in scenes' classification
sets (test split, in-domain). With k = m the subset is every sub-sphere: the full model's accuracy.
"""
from __future__ import annotations

import itertools
import math
from typing import Sequence

import torch

from topoclip.analysis.output import pyplot, save_figure, write_json
from topoclip.config import ConfigError
from topoclip.run.evaluation.metrics import ClassificationAccumulator
from topoclip.run.evaluation.zeroshot import embed_images, evaluating, zero_shot_classifier
from topoclip.run.inference import Pretrained

SETS = ("shape", "colour", "composition")


def subset_sizes(m: int) -> list[int]:
    """1, 2, 4, … below m, then m."""
    sizes = [2**i for i in range(int(math.log2(m)) + 1) if 2**i < m]
    return sizes + [m]


def draw_subsets(m: int, k: int, draws: int, generator: torch.Generator) -> list[tuple[int, ...]]:
    """Every k-subset of range(m) when there are at most `draws`, else `draws` distinct random ones."""
    if math.comb(m, k) <= draws:
        return list(itertools.combinations(range(m), k))
    chosen: set[tuple[int, ...]] = set()
    while len(chosen) < draws:
        chosen.add(tuple(sorted(torch.randperm(m, generator=generator)[:k].tolist())))
    return sorted(chosen)


class SubsetScorer:
    """Stands in for the model when scoring: the model's similarity of the chosen sub-spheres (factors) only."""

    def __init__(self, model, subset: Sequence[int]):
        self.model = model
        self.subset = list(subset)

    def similarity(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(Bu, m, n), (Bv, m, n) -> (Bu, Bv) using rows `subset` of both."""
        index = torch.tensor(self.subset, device=u.device)
        return self.model.similarity(u.index_select(1, index), v.index_select(1, index))


def subset_accuracy(classifier, image_embeddings: torch.Tensor, labels: torch.Tensor, model,
                    subset: Sequence[int]) -> float:
    """Top-1 (percent) of a ZeroShotClassifier on embedded images (N, m, n), scored with `subset` only."""
    accumulator = ClassificationAccumulator(classifier.num_classes)
    scorer = SubsetScorer(model, subset)
    for start in range(0, image_embeddings.shape[0], 1024):
        scores = classifier.scores(scorer, image_embeddings[start : start + 1024])
        accumulator.update(scores, labels[start : start + 1024])
    return accumulator.compute()["top1"]


def subset_curve(classifier, image_embeddings: torch.Tensor, labels: torch.Tensor, model, draws: int,
                 generator: torch.Generator) -> list[dict]:
    """[{k, subsets, accuracies, mean, std}] for k = 1, 2, 4, …, m."""
    m = image_embeddings.shape[1]
    rows = []
    for k in subset_sizes(m):
        subsets = draw_subsets(m, k, draws, generator)
        accuracies = torch.tensor([subset_accuracy(classifier, image_embeddings, labels, model, s) for s in subsets])
        rows.append({"k": k, "subsets": subsets, "accuracies": accuracies.tolist(), "mean": accuracies.mean().item(),
                     "std": accuracies.std().item() if len(subsets) > 1 else 0.0})
    return rows


def plot_curves(result: dict, out_dir):
    """experts.png: top-1 against the number of sub-spheres used, mean ± std, one line per set."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6, 4))
    for name, curve in result["sets"].items():
        ks = [row["k"] for row in curve["subsets"]]
        axis.errorbar(ks, [row["mean"] for row in curve["subsets"]], yerr=[row["std"] for row in curve["subsets"]],
                      marker="o", capsize=3, label=f"{name} (chance {100 / curve['classes']:.1f})")
    axis.set_xscale("log", base=2)
    axis.set_xlabel(f"sub-spheres used, of m = {result['spheres']}")
    axis.set_ylabel("zero-shot top-1 (%)")
    axis.set_title(f"random subsets of the sub-spheres ({result['mode']} mode)", fontsize=9)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    return save_figure(figure, out_dir, "experts")


def analyze_experts(loaded: Pretrained, out_dir, size: int = 400, draws: int = 10, mode: str = "distance",
                    sets: Sequence[str] = SETS, seed: int = 0, batch_size: int = 256) -> dict:
    """Write experts.png and experts.json for the built-in classification sets named in `sets`."""
    from topoclip.data.scenes import classification_sets

    model, config = loaded.model, loaded.config
    available = {s.name: s for s in classification_sets(config.data.scenes, "test", size, include_out_of_domain=False)}
    unknown = [name for name in sets if name not in available]
    if unknown:
        raise ConfigError(f"unknown set(s) {unknown}; choose from {sorted(available)}")
    generator = torch.Generator().manual_seed(seed)
    m = model.embedding_shape[0]
    result = {"analysis": "experts", "model": loaded.name, "checkpoint": str(loaded.checkpoint),
              "topology": model.config.topology, "spheres": m, "mode": mode, "size": size, "draws": draws,
              "seed": seed, "sets": {}}
    for name in sets:
        dataset = available[name]
        classifier = zero_shot_classifier(model, loaded.tokenizer, dataset.classnames, dataset.templates, mode,
                                          batch_size, loaded.device)
        images = embed_images(model, dataset.images, loaded.transform, batch_size, loaded.device)
        with evaluating(model):
            curve = subset_curve(classifier, images, dataset.labels, model, draws, generator)
        result["sets"][name] = {"classes": len(dataset.classnames), "full_model_top1": curve[-1]["mean"],
                                "subsets": curve}
    result["plots"] = [plot_curves(result, out_dir).name]
    write_json(out_dir, "experts", result)
    return result
