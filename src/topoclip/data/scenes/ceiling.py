"""The ceiling of retrieval on the built-in scenes: what the Bayes-optimal ranker would score.

The captions are partial (a caption is true of many images, an image has many true captions), so R@K, which counts
only the paired caption or image, cannot reach 100 — and how far below 100 it stops depends on how the generator
(captions.sample_caption) chooses what to say. The generator is known, so the probability that it writes caption c
for scene s, L(c, s) = P(c | s), is computed here exactly, by summing over the ways it can write that text: which
kind of caption (by the scene's object count), which object(s), which attributes, which position phrase (its
options depend on the object's cell), which relation (uniform over those that hold), which template.

With every image equally likely to be a caption's source, the best any model can do is rank by L:
- text→image: the posterior of image j for caption c is L(c, j) / Σ_j' L(c, j'); the expected R@K of ranking by it is
  the posterior mass of the K best images (ties share the boundary);
- image→text: the posterior that caption c was written for image i is L(c, i) / Σ_j L(c, j); ranking an image's
  captions by it, the expected R@K (a hit when one of the image's captions is in the top K) is
  1 − Π over the top K of (1 − posterior), treating the captions' sources as independent draws.
Both are expectations over the generator, not a sample of it. They assume captions drawn independently; the
retrieval set's captions of one image are distinct texts (dataset.annotated_captions_for), which this ignores.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .captions import Caption
from .config import COLOUR_NAMES, SHAPES, SIZES
from .layout import RELATIONS, Scene
from .retrieval import _CODE_CELL, _CODE_COLOUR, _CODE_SHAPE, _CODE_SIZE, _CODES, _image_codes

# sample_caption's choices, as it draws them.
KIND_GIVEN_SEVERAL = {"one": 0.4, "count": 0.1, "relation": 0.3, "pair": 0.2}  # a scene of n > 1 objects
TEMPLATE = {"one": 1 / 5, "count": 1.0, "relation": 1 / 3, "pair": 1 / 3}  # pair: 2 templates + the count one
NAMES = {(True, True): 0.7 * 0.7, (True, False): 0.7 * 0.3 + 0.3 * 0.3 * 0.5,  # (colour said, shape said)
         (False, True): 0.3 * 0.7 + 0.3 * 0.3 * 0.5}
NOUN = 0.5  # "object" or "shape" when the shape is not said
SIZE_SAID, POSITION_SAID = 0.3, 0.25
KS = (1, 5, 10)


def kind_of(caption: Caption) -> str:
    if caption.relation is not None:
        return "relation"
    if len(caption.mentions) == 2:
        return "pair"
    return "count" if caption.count is not None else "one"


def _position_options() -> np.ndarray:
    """(9,) the number of position phrases sample_caption can choose for an object in each grid cell."""
    row, column = _CODE_CELL[:9] // 3, _CODE_CELL[:9] % 3
    return np.where((row == 1) & (column == 1), 1, np.where((row != 1) & (column != 1), 3, 1))


def mention_table(mention, allow_position: bool) -> np.ndarray:
    """(_CODES,) P(the words of `mention` | an object of each code) under sample_caption's _sample_mention."""
    p = np.full(_CODES, NAMES[(mention.colour is not None, mention.shape is not None)])
    if mention.colour is not None:
        p = p * (_CODE_COLOUR == COLOUR_NAMES.index(mention.colour))
    if mention.shape is not None:
        p = p * (_CODE_SHAPE == SHAPES.index(mention.shape))
    else:
        p = p * NOUN
    p = p * ((SIZE_SAID * (_CODE_SIZE == SIZES.index(mention.size))) if mention.size is not None else 1 - SIZE_SAID)
    row, column = _CODE_CELL // 3, _CODE_CELL % 3
    if mention.row is None and mention.column is None:
        return p * (1 - POSITION_SAID if allow_position else 1.0)
    if not allow_position:
        return np.zeros(_CODES)
    valid = np.ones(_CODES, dtype=bool)
    if mention.row is not None:
        valid &= row == mention.row
    if mention.column is not None:
        valid &= column == mention.column
    return p * POSITION_SAID * valid / _position_options()[_CODE_CELL]


def likelihoods(scenes: Sequence[Scene], captions: Sequence[Caption], chunk: int = 256) -> torch.Tensor:
    """(T, N) float64: L[c, j] = P(sample_caption writes captions[c] | scenes[j])."""
    width = max(len(scene.objects) for scene in scenes)
    codes, relations, counts = (torch.from_numpy(array) for array in _image_codes(scenes, width))
    counts_f = counts.double()
    several = counts > 1
    holding = relations[..., : len(RELATIONS)].sum(-1).double()  # (N, W, W) relations that hold for (a, b)
    blocks = []
    for start in range(0, len(captions), chunk):
        part = captions[start : start + chunk]
        kinds = [kind_of(caption) for caption in part]
        tables = torch.zeros(len(part), 2, _CODES + 1, dtype=torch.float64)  # padding objects: probability 0
        for c, (caption, kind) in enumerate(zip(part, kinds)):
            for d, mention in enumerate(caption.mentions):
                tables[c, d, :_CODES] = torch.from_numpy(mention_table(mention, allow_position=kind != "relation"))
        first = tables[:, 0][:, codes]  # (t, N, W)
        single = first.sum(-1) / counts_f  # (t, N): one object chosen uniformly
        second = tables[:, 1][:, codes]
        pair = torch.zeros_like(single)
        for a in range(width):
            for b in range(width):
                if a == b:
                    continue
                factor = torch.ones(len(part), len(scenes), dtype=torch.float64)
                for c, caption in enumerate(part):
                    if caption.relation is not None:  # the relation is drawn uniformly among those that hold
                        holds = relations[:, a, b, RELATIONS.index(caption.relation)].double()
                        factor[c] = holds / holding[:, a, b].clamp(min=1)
                pair += first[:, :, a] * second[:, :, b] * factor
        pair = pair / (counts_f * (counts_f - 1)).clamp(min=1)  # an ordered pair of distinct objects
        rows = []
        for c, (caption, kind) in enumerate(zip(part, kinds)):
            chosen = torch.where(several, KIND_GIVEN_SEVERAL[kind], 1.0 if kind == "one" else 0.0).double()
            value = (pair[c] if kind in ("relation", "pair") else single[c]) * chosen * TEMPLATE[kind]
            if caption.count is not None:
                value = value * (counts == caption.count)
            rows.append(value)
        blocks.append(torch.stack(rows))
    return torch.cat(blocks)


def ceiling(likelihood: torch.Tensor, owners: torch.Tensor, ks: Sequence[int] = KS) -> dict[str, float]:
    """The Bayes-optimal ranker's expected recall (percent), in evaluate_retrieval's keys, from (T, N) likelihoods
    and each caption's image (T,)."""
    total = likelihood.sum(1, keepdim=True)  # (T, 1); > 0: every caption is true of its own image
    posterior = likelihood / total  # (T, N): which image wrote caption c
    result = {}
    to_image, to_text = [], []
    ordered, _ = posterior.sort(dim=1, descending=True)  # text→image: the posterior mass of the K best images
    for k in ks:
        recall = ordered[:, :k].sum(1).mean().item() * 100
        result[f"image_retrieval_recall@{k}"] = recall
        to_image.append(recall)
    queries = torch.bincount(owners, minlength=likelihood.shape[1]).nonzero().squeeze(1)
    by_image, _ = posterior[:, queries].T.sort(dim=1, descending=True)  # (Q, T): the captions' chance of being i's
    for k in ks:
        recall = (1 - torch.prod(1 - by_image[:, :k], dim=1)).mean().item() * 100
        result[f"text_retrieval_recall@{k}"] = recall
        to_text.append(recall)
    result["mean_recall"] = (sum(to_image) / len(ks) + sum(to_text) / len(ks)) / 2
    return result


def realized(likelihood: torch.Tensor, owners: torch.Tensor, ks: Sequence[int] = KS) -> dict[str, float]:
    """The recall (percent) the Bayes-optimal ranking scores on this very set — the comparator of a model's numbers
    on it — with ties broken at random, in expectation (exact: a tie of g items holding s positives, r of them
    taken, misses all positives with probability C(g − s, r) / C(g, r))."""
    from math import comb

    def hit(scores: torch.Tensor, positive: torch.Tensor, k: int) -> float:
        top = scores[positive].max()
        above = int((scores > top).sum())
        if above >= k:
            return 0.0
        tied = scores == top
        group, inside, taken = int(tied.sum()), int((tied & positive).sum()), k - above
        if taken >= group:
            return 1.0
        return 1.0 - comb(group - inside, taken) / comb(group, taken)

    posterior = likelihood / likelihood.sum(1, keepdim=True)
    result, to_image, to_text = {}, [], []
    images = torch.arange(likelihood.shape[1])
    for k in ks:
        recall = 100 * sum(hit(likelihood[c], images == owners[c], k) for c in range(len(owners))) / len(owners)
        result[f"image_retrieval_recall@{k}"] = recall
        to_image.append(recall)
    queries = torch.bincount(owners, minlength=likelihood.shape[1]).nonzero().squeeze(1).tolist()
    for k in ks:
        recall = 100 * sum(hit(posterior[:, i], owners == i, k) for i in queries) / len(queries)
        result[f"text_retrieval_recall@{k}"] = recall
        to_text.append(recall)
    result["mean_recall"] = (sum(to_image) / len(ks) + sum(to_text) / len(ks)) / 2
    return result


def retrieval_ceiling(config, split: str = "test", size: int = 1000, captions_per_image: int = 5) -> dict:
    """The ceiling of the built-in retrieval set `retrieval_set(config, split, size, captions_per_image)`:
    {"expected": over the generator's draws (`ceiling`), "this_set": on these captions (`realized`)}."""
    from .dataset import SceneDataset

    dataset = SceneDataset(config, split)
    scenes, captions, owners = [], [], []
    for i in range(size):
        scenes.append(dataset.scene(i))
        for caption in dataset.annotated_captions_for(i, captions_per_image):
            captions.append(caption)
            owners.append(i)
    likelihood, owners = likelihoods(scenes, captions), torch.tensor(owners)
    return {"expected": ceiling(likelihood, owners), "this_set": realized(likelihood, owners)}
