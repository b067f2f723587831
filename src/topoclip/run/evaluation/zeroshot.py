"""Zero-shot classification: class prompts -> text embeddings -> scores for every image.

The model interface this module (and retrieval.py) is written against:

- ``model.encode_image(images (B, 3, H, W)) -> (B, m, n)`` and ``model.encode_text(batch) ->
  (B, m, n)``, already on the model's space; ``batch = tokenizer(list_of_str)`` has ``.to(device)``;
- ``model.similarity(u (Bu, m, n), v (Bv, m, n)) -> (Bu, Bv)`` fp32, higher = more similar;
- ``model.config.topology``: the space's name for :func:`topoclip.core.geometry.centroid`, with
  ``model.curvature_value`` (a hyperbolic model's c; optional, None for the other spaces).
The model must already be on ``device``; runners only move inputs there.

Three ways to turn T templates into a class score (the first two are the paper's):

- ``"distance"`` (the paper): score(x, c) = (1/T) Σ_t s(x, text(c, t)). The C·T prompt embeddings
  are kept; an image batch is scored against all of them at once, so at most (batch, C·T)
  scores exist at a time, then averaged per class to (batch, C).
- ``"embedding"`` (CLIP): e_c = to_space((1/T) Σ_t text(c, t)) — the mean embedding projected back
  onto the space (for product spheres: each sub-sphere renormalised; for the hyperboloids the mean of
  the tangent vectors at the origin, mapped back, as MERU's classifier) — scored once: s(x, e_c).
- ``"flat"`` (CLIP_benchmark's, for "sphere" and "ps-inner" only): e_c = mean_t flat(text(c, t)) /
  ‖mean_t flat(text(c, t))‖ — the flat (m·n) vectors' mean normalised as one vector, as CLIP_benchmark
  does with any model's (B, d) features — scored once by the inner product, which is s for these two.

With one template the modes rank alike for every topology ("flat" divides every class by the same
√m). For "ps-inner" (and "sphere") the similarity is linear in v, so the distance mode equals the
inner product with the *un-renormalised* mean; the embedding mode rescales each sub-sphere's mean,
which weights the m sub-spheres differently; the flat mode rescales each class's whole mean by one
factor. On the sphere, "flat" equals "embedding".

This module also holds the pieces both zero-shot runners share: the embedding loops and the
result record.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.data
from tqdm.auto import tqdm

from topoclip.data.types import ClassificationSet
from topoclip.core.distributed import is_sharded
from topoclip.run.evaluation.metrics import ClassificationAccumulator
from topoclip.core.errors import UserError
from topoclip.core.geometry import NORM_EPSILON, centroid, flatten
from topoclip.config.schema import TEMPLATE_MODES
from topoclip.core.workers import settle_before_fork, worker_options

MODES = tuple(TEMPLATE_MODES)  # (see the module docstring; the names are the config's: evaluate.template_modes)
TASKS = ("zeroshot_classification", "zeroshot_retrieval")


# --------------------------------------------------------------------------- embedding loops


@contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """model.eval() and inference mode inside; the model's previous train/eval mode after."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


class _Transformed(torch.utils.data.Dataset):
    """i -> image_transform(images[first + i]) (3, H, W), in a DataLoader worker."""

    def __init__(self, images: Sequence, image_transform: Callable[[Any], torch.Tensor], first: int, stop: int):
        self.images, self.image_transform, self.first, self.stop = images, image_transform, first, stop

    def __len__(self) -> int:
        return self.stop - self.first

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.image_transform(self.images[self.first + index])


def _pixel_batches(images: Sequence, image_transform, batch_size: int, first: int, stop: int,
                   workers: int) -> Iterator[torch.Tensor]:
    """(B, 3, H, W) batches of images[first:stop] in order; in `workers` DataLoader workers only when the images are
    decoded on access (files, tar members): those already in memory (a list, an array) only need the transform."""
    pixels = _Transformed(images, image_transform, first, stop)
    if workers and not isinstance(images, (list, tuple, np.ndarray)):
        settle_before_fork()
        yield from torch.utils.data.DataLoader(pixels, batch_size=batch_size, **worker_options(workers))
        return
    for start in range(0, len(pixels), batch_size):
        yield torch.stack([pixels[i] for i in range(start, min(start + batch_size, len(pixels)))])


def _rank_share(total: int) -> tuple[int, int, int, int]:
    """(start, stop, rows per rank, ranks) of this rank's contiguous share of `total` images; the whole in one
    process. A rank whose share is empty (fewer images than ranks) still takes part in the gather."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 0, total, total, 1
    world = dist.get_world_size()
    per = max(1, -(-total // world))
    rank = dist.get_rank()
    return min(rank * per, total), min((rank + 1) * per, total), per, world


def image_embedding_batches(
    model, images: Sequence, image_transform: Callable[[Any], torch.Tensor], batch_size: int, device,
    workers: int = 0,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield (start, stop, embeddings (stop − start, m, n)) over `images` in order.

    Each image (PIL.Image or uint8 (H, W, 3) array) goes through `image_transform` -> (3, H, W), in `workers`
    DataLoader workers unless `images` is an array in memory (where a worker would only add its start-up): as
    `topoclip embed` does, so that ImageNet's 50,000 JPEGs are not decoded one at a time by the process that
    holds the model (evaluate.num_workers). Under torch.distributed every rank embeds a contiguous share
    of the images and the shares are gathered (features, not images), so every rank yields every batch: call
    it on every rank. Call inside :func:`evaluating`.
    """
    total = len(images)
    start, stop, per, world = _rank_share(total)
    with tqdm(total=stop - start, desc="images", unit="image", disable=None, leave=False) as progress:
        blocks = []
        for pixels in _pixel_batches(images, image_transform, batch_size, start, stop, workers):
            blocks.append(model.encode_image(pixels.to(device)))
            progress.update(len(pixels))
    if world > 1 and is_sharded(model):  # each forward gathers the shards from every rank: all run as many
        size = model.config.vision.image_size
        for _ in range(-(-per // batch_size) - len(blocks)):
            model.encode_image(torch.zeros(1, 3, size, size, device=device))
    embeddings = torch.cat(blocks) if blocks else torch.zeros(0, *model.embedding_shape, device=device)  # (n_r, m, n)
    if world > 1:  # every rank's share, padded to `per` rows for the gather, in rank order
        padded = torch.cat([embeddings, embeddings.new_zeros(per - len(embeddings), *embeddings.shape[1:])])
        shares = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
        dist.all_gather(shares, padded)
        embeddings = torch.cat([share[: max(0, min(per, total - rank * per))] for rank, share in enumerate(shares)])
    for begin in range(0, total, batch_size):
        yield begin, min(begin + batch_size, total), embeddings[begin : begin + batch_size]


def embed_images(model, images: Sequence, image_transform, batch_size: int = 256, device="cpu",
                 workers: int = 0) -> torch.Tensor:
    """All images -> (N, m, n) on `device` (see image_embedding_batches)."""
    with evaluating(model):
        blocks = [e for _, _, e in image_embedding_batches(model, images, image_transform, batch_size, device, workers)]
    return torch.cat(blocks)


def embed_texts(model, tokenizer, texts: Sequence[str], batch_size: int = 256, device="cpu") -> torch.Tensor:
    """All texts -> (T, m, n) on `device`, tokenized and encoded `batch_size` at a time."""
    blocks = []
    with evaluating(model), tqdm(total=len(texts), desc="texts", unit="text", disable=None, leave=False) as progress:
        for start in range(0, len(texts), batch_size):
            chunk = list(texts[start : start + batch_size])
            blocks.append(model.encode_text(tokenizer(chunk).to(device)))
            progress.update(len(chunk))
    return torch.cat(blocks)


# --------------------------------------------------------------------------- classifier


@dataclass
class ZeroShotClassifier:
    """Class text embeddings ready to score images.

    embeddings: "distance" mode: (C·T, m, n), class-major (row c·T + t = class c, template t);
    "embedding" mode: (C, m, n), one re-projected mean per class; "flat": (C, m, n), one mean per class
    normalised as one m·n vector.
    """

    mode: str
    embeddings: torch.Tensor
    num_classes: int
    num_templates: int

    def scores(self, model, image_embeddings: torch.Tensor) -> torch.Tensor:
        """(B, m, n) image embeddings -> (B, C) class scores (fp32, higher = more likely)."""
        similarity = model.similarity(image_embeddings, self.embeddings)  # (B, C·T) or (B, C)
        if self.mode != "distance":
            return similarity
        per_template = similarity.view(-1, self.num_classes, self.num_templates)  # (B, C, T)
        return per_template.mean(dim=-1)  # (B, C)


def check_template(template: str) -> None:
    """A prompt template holds exactly one empty {} for the class name; UserError otherwise (a template
    without one gives every class the same prompt, so uniform probabilities)."""
    import string

    example = 'e.g. "a photo of a {}."'
    try:
        parsed = [(field, spec, conversion) for _, field, spec, conversion in string.Formatter().parse(template)
                  if field is not None]
    except ValueError as error:
        raise UserError(f"template {template!r} is not a format string ({error}); write {{{{ and }}}} for "
                        f"literal braces, {example}") from None
    fields = [field for field, _, _ in parsed]
    if fields == [""] and parsed[0][1:] != ("", None):  # "{:>200000000}" would size a string from the template
        raise UserError(f"template {template!r} gives its {{}} a format spec or conversion "
                        f"({parsed[0][1] or '!' + str(parsed[0][2])!r}); write a plain {{}}, {example}")
    if fields != [""]:
        named = f", named {fields}" if any(fields) else ""
        raise UserError(f"template {template!r} must hold one {{}} where the class name goes (it has "
                        f"{len(fields)} field(s){named}), {example}")


def zero_shot_classifier(
    model,
    tokenizer,
    classnames: Sequence[str],
    templates: Sequence[str],
    mode: str = "distance",
    batch_size: int = 256,
    device="cpu",
) -> ZeroShotClassifier:
    """Embed every (class, template) prompt; keep them ("distance") or their per-class mean ("embedding").

    Templates contain one "{}" for the class name, e.g. "a photo of a {}.".
    """
    if mode not in MODES:
        raise ValueError(f"unknown zero-shot mode {mode!r}; choose one of {MODES}")
    if not classnames or not templates:
        raise ValueError(f"need at least one class and one template; got {len(classnames)} and {len(templates)}")
    for template in templates:
        check_template(template)
    prompts = [template.format(name) for name in classnames for template in templates]  # class-major
    texts = embed_texts(model, tokenizer, prompts, batch_size, device)  # (C·T, m, n)
    num_classes, num_templates = len(classnames), len(templates)
    if mode == "embedding":
        per_class = texts.float().view(num_classes, num_templates, *texts.shape[1:]).transpose(0, 1)  # (T, C, m, n)
        texts = centroid(model.config.topology, per_class, getattr(model, "curvature_value", None))  # (C, m, n)
    elif mode == "flat":
        flat = flatten(model.config.topology, texts.float()).view(num_classes, num_templates, -1).mean(dim=1)
        texts = F.normalize(flat, dim=-1, eps=NORM_EPSILON).view(num_classes, *texts.shape[1:])  # (C, m, n)
    return ZeroShotClassifier(mode, texts, num_classes, num_templates)


# --------------------------------------------------------------------------- protocol


def evaluate_classification(
    model,
    tokenizer,
    dataset: ClassificationSet,
    image_transform: Callable[[Any], torch.Tensor],
    mode: str = "distance",
    batch_size: int = 256,
    device="cpu",
) -> dict:
    """Zero-shot classification of `dataset` -> {"top1", "top5", "mean_per_class_recall"} (percent) + "mode"."""
    return evaluate_classification_modes(model, tokenizer, dataset, image_transform, [mode], batch_size, device)[0]


def evaluate_classification_modes(
    model,
    tokenizer,
    dataset: ClassificationSet,
    image_transform: Callable[[Any], torch.Tensor],
    modes: Sequence[str] = MODES,
    batch_size: int = 256,
    device="cpu",
    workers: int = 0,
) -> list[dict]:
    """`evaluate_classification` for several template modes, encoding the images once (in `workers` decoding
    processes; see image_embedding_batches): one dict per mode."""
    classifiers = [zero_shot_classifier(model, tokenizer, dataset.classnames, dataset.templates, mode, batch_size, device)
                   for mode in modes]
    labels = torch.as_tensor(dataset.labels, dtype=torch.int64)
    if labels.shape[0] != len(dataset.images):
        raise ValueError(f"{dataset.name}: {labels.shape[0]} labels for {len(dataset.images)} images")
    accumulators = [ClassificationAccumulator(classifier.num_classes) for classifier in classifiers]
    with evaluating(model):
        for start, stop, embeddings in image_embedding_batches(model, dataset.images, image_transform, batch_size, device,
                                                               workers):
            for classifier, accumulator in zip(classifiers, accumulators):
                accumulator.update(classifier.scores(model, embeddings), labels[start:stop])
    return [{**accumulator.compute(), "mode": mode} for mode, accumulator in zip(modes, accumulators)]


def record(dataset_name: str, model_name: str, task: str, metrics: dict, domain: str = "") -> dict:
    """One result, CLIP_benchmark-style: {"dataset", "model", "task", "metrics"} (+ "domain" when known)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")
    result = {"dataset": dataset_name, "model": model_name, "task": task, "metrics": dict(metrics)}
    if domain:
        result["domain"] = domain
    return result
