"""Retrieval and classification metrics, computed block by block so no N × N matrix is ever held.

Both tasks score a query (a row) against items (columns); higher score = better. The metrics
are sums of per-query values, so a caller feeds rows in chunks to an accumulator and divides once.

Ranking rule (deterministic, used everywhere here): items are ordered by descending score, and
items with equal scores keep their index order. So item k is ranked above item j iff
``score[k] > score[j]``, or ``score[k] == score[j]`` and ``k < j``. A constant scorer therefore
ranks items in index order; it is neither the optimistic nor the pessimistic tie convention.

Retrieval (several positives per query; ECCV Caption / Musgrave et al. "A metric learning
reality check"), for one query with ranked relevance rel(1), rel(2), ... and R relevant items:

    R@K        = 1 if any relevant item is among the top K, else 0   (K > N means all N)
    P@r        = (1/r) · Σ_{i≤r} rel(i)
    R-Precision = P@R
    mAP@R      = (1/R) · Σ_{r≤R} P@r · rel(r)

R@K may use a different positive set ("paired": e.g. the captions written for the image, the
CLIP_benchmark convention) from mAP@R and R-Precision ("relevant": semantic ground truth).

Classification (C classes): the true class's rank follows the same rule; top-k counts rank ≤ k
with k = min(k, C); mean per-class recall is the top-1 recall averaged over the classes that
occur among the labels (classes without samples have no recall and are left out, as in
scikit-learn's balanced accuracy).

All accumulators report percentages (0–100).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

DEFAULT_KS = (1, 5, 10)


# --------------------------------------------------------------------------- ranking


def rank_order(scores: torch.Tensor) -> torch.Tensor:
    """(q, N) scores -> (q, N) item indices, best first, ties broken by the smaller index."""
    if torch.isnan(scores).any():
        raise ValueError("scores contain NaN; a ranking is undefined")
    return torch.sort(scores, dim=1, descending=True, stable=True).indices


def _check_positives(mask: torch.Tensor, what: str, first_query: int) -> None:
    """Raise a ValueError naming the first query (global row index) with no positive in `mask`."""
    empty = ~mask.any(dim=1)  # (q,)
    if empty.any():
        row = int(empty.nonzero()[0, 0]) + first_query
        raise ValueError(f"query {row} has no {what} item; every query needs at least one")


# --------------------------------------------------------------------------- retrieval


def retrieval_per_query(
    scores: torch.Tensor,
    relevant: torch.Tensor,
    paired: Optional[torch.Tensor] = None,
    ks: Sequence[int] = DEFAULT_KS,
) -> dict[str, torch.Tensor]:
    """Per-query retrieval values, each a (q,) float64 tensor in [0, 1].

    scores (q, N): higher = better. relevant (q, N) bool: positives for mAP@R and R-Precision.
    paired (q, N) bool or None: positives for R@K (default: `relevant`).
    Returns {"R@k" for k in ks, "mAP@R", "R-Precision"} (formulas in the module docstring).
    """
    if scores.dim() != 2 or relevant.shape != scores.shape:
        raise ValueError(f"scores and relevant must both be (q, N); got {tuple(scores.shape)} and {tuple(relevant.shape)}")
    paired = relevant if paired is None else paired
    if paired.shape != scores.shape:
        raise ValueError(f"paired must be (q, N) like scores; got {tuple(paired.shape)}")
    relevant, paired = relevant.to(scores.device, torch.bool), paired.to(scores.device, torch.bool)
    _check_positives(relevant, "relevant", 0)
    _check_positives(paired, "paired", 0)

    order = rank_order(scores)  # (q, N)
    values: dict[str, torch.Tensor] = {}

    # R@K only needs the first max(ks) ranks of the paired positives.
    top = min(max(ks), scores.shape[1])
    paired_ranked = paired.gather(1, order[:, :top])  # (q, top)
    for k in ks:
        values[f"R@{k}"] = paired_ranked[:, :k].any(dim=1).double()

    # mAP@R and R-P only need the first R ranks; R differs per query, so cut at the block's max R.
    num_relevant = relevant.sum(dim=1)  # (q,) = R, ≥ 1
    cut = int(num_relevant.max())
    relevant_ranked = relevant.gather(1, order[:, :cut])  # (q, cut): rel(r) for r ≤ cut
    hits = relevant_ranked.cumsum(dim=1).double()  # (q, cut): Σ_{i≤r} rel(i)
    ranks = torch.arange(1, cut + 1, device=scores.device, dtype=torch.float64)  # (cut,) = r
    within_r = ranks[None, :] <= num_relevant[:, None]  # (q, cut): r ≤ R
    precision = hits / ranks  # (q, cut): P@r
    r = num_relevant.double()
    values["mAP@R"] = (precision * (relevant_ranked & within_r)).sum(dim=1) / r
    values["R-Precision"] = hits.gather(1, (num_relevant - 1)[:, None]).squeeze(1) / r
    return values


class RetrievalAccumulator:
    """Sums per-query retrieval values over row blocks; `compute()` averages them in percent.

    Queries are rows: feed each block of query rows once, against all N items.
    `compute()` -> {"R@1", "R@5", "R@10" (one per k in ks), "mean_recall" (mean of the R@k),
    "mAP@R", "R-Precision"}, all in percent.
    """

    def __init__(self, ks: Sequence[int] = DEFAULT_KS):
        if not ks or any(k < 1 for k in ks):
            raise ValueError(f"ks must be positive integers; got {tuple(ks)}")
        self.ks = tuple(ks)
        self.num_queries = 0
        self._sums = {name: 0.0 for name in self._names()}

    def _names(self) -> list[str]:
        return [f"R@{k}" for k in self.ks] + ["mAP@R", "R-Precision"]

    def update(
        self, scores: torch.Tensor, relevant: torch.Tensor, paired: Optional[torch.Tensor] = None
    ) -> None:
        """Add a block of queries: scores (q, N), relevant (q, N) bool, paired (q, N) bool or None."""
        # Checked here too so the error names the query's row over all blocks, not within this one.
        _check_positives(relevant.bool(), "relevant", self.num_queries)
        if paired is not None:
            _check_positives(paired.bool(), "paired", self.num_queries)
        values = retrieval_per_query(scores, relevant, paired, self.ks)
        for name, per_query in values.items():
            self._sums[name] += float(per_query.sum())
        self.num_queries += scores.shape[0]

    def compute(self) -> dict[str, float]:
        if self.num_queries == 0:
            raise ValueError("no queries were added")
        result = {name: 100.0 * total / self.num_queries for name, total in self._sums.items()}
        recalls = [result[f"R@{k}"] for k in self.ks]
        ordered = {f"R@{k}": result[f"R@{k}"] for k in self.ks}
        ordered["mean_recall"] = sum(recalls) / len(recalls)
        ordered["mAP@R"] = result["mAP@R"]
        ordered["R-Precision"] = result["R-Precision"]
        return ordered


def retrieval_metrics(
    scores: torch.Tensor,
    relevant: torch.Tensor,
    paired: Optional[torch.Tensor] = None,
    ks: Sequence[int] = DEFAULT_KS,
) -> dict[str, float]:
    """One-block convenience: RetrievalAccumulator(ks) updated once with the whole (q, N) matrix."""
    accumulator = RetrievalAccumulator(ks)
    accumulator.update(scores, relevant, paired)
    return accumulator.compute()


# --------------------------------------------------------------------------- classification


def true_class_rank(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(N, C) scores, (N,) labels -> (N,) 1-based rank of the true class under the ranking rule."""
    true_score = scores.gather(1, labels[:, None])  # (N, 1)
    class_index = torch.arange(scores.shape[1], device=scores.device)  # (C,)
    above = (scores > true_score) | ((scores == true_score) & (class_index[None, :] < labels[:, None]))
    return above.sum(dim=1) + 1  # (N,)


class ClassificationAccumulator:
    """Per-class counts over blocks of samples; `compute()` -> {"top1", "top5", "mean_per_class_recall"}.

    top5 uses k = min(5, C). Mean per-class recall averages top-1 recall over the classes that
    have at least one sample. All in percent.
    """

    def __init__(self, num_classes: int):
        if num_classes < 1:
            raise ValueError(f"num_classes must be ≥ 1; got {num_classes}")
        self.num_classes = num_classes
        self.samples_per_class = torch.zeros(num_classes, dtype=torch.int64)
        self.top1_per_class = torch.zeros(num_classes, dtype=torch.int64)
        self.top5_correct = 0

    @property
    def num_samples(self) -> int:
        return int(self.samples_per_class.sum())

    def update(self, scores: torch.Tensor, labels: torch.Tensor) -> None:
        """Add a block: scores (B, C) (higher = more likely), labels (B,) int in [0, C)."""
        if scores.dim() != 2 or scores.shape[1] != self.num_classes:
            raise ValueError(f"scores must be (B, {self.num_classes}); got {tuple(scores.shape)}")
        if torch.isnan(scores).any():
            raise ValueError("scores contain NaN; a ranking is undefined")
        labels = labels.to(device=scores.device, dtype=torch.int64).reshape(-1)
        if labels.shape[0] != scores.shape[0]:
            raise ValueError(f"{labels.shape[0]} labels for {scores.shape[0]} score rows")
        if labels.numel() and (labels.min() < 0 or labels.max() >= self.num_classes):
            raise ValueError(f"labels must lie in [0, {self.num_classes}); got [{int(labels.min())}, {int(labels.max())}]")
        rank = true_class_rank(scores, labels).cpu()  # (B,)
        labels = labels.cpu()
        self.samples_per_class += torch.bincount(labels, minlength=self.num_classes)
        self.top1_per_class += torch.bincount(labels[rank == 1], minlength=self.num_classes)
        self.top5_correct += int((rank <= min(5, self.num_classes)).sum())

    def compute(self) -> dict[str, float]:
        total = self.num_samples
        if total == 0:
            raise ValueError("no samples were added")
        present = self.samples_per_class > 0
        recall = self.top1_per_class[present].double() / self.samples_per_class[present].double()
        return {
            "top1": 100.0 * int(self.top1_per_class.sum()) / total,
            "top5": 100.0 * self.top5_correct / total,
            "mean_per_class_recall": 100.0 * float(recall.mean()),
        }


def classification_metrics(scores: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """{"top1", "top5", "mean_per_class_recall"} in percent for scores (N, C) and labels (N,)."""
    accumulator = ClassificationAccumulator(scores.shape[1])
    accumulator.update(scores, labels)
    return accumulator.compute()
