"""Zero-shot retrieval, image→text and text→image, scored in query chunks (no N × T matrix held).

Positives, per metric:
- R@1, R@5, R@10: the *paired* items — for an image query its own captions (several positives),
  for a caption query the image it was written for. This is the CLIP_benchmark convention.
- mAP@R and R-Precision: the *relevant* items, `dataset.relevant(...)` — the semantic ground truth
  when the data set has one (ECCV Caption style), else the pairing again.

Images without any caption are not image→text queries (they have no paired positive) but stay
in the gallery as distractors for text→image.

Output keys (percent), CLIP_benchmark naming for recall — "image_retrieval" means retrieving
images, i.e. text→image queries; "text_retrieval" means image→text:
    image_retrieval_recall@{1,5,10}, text_retrieval_recall@{1,5,10},
    mean_recall (mean of those six),
    image_to_text_mAP@R, image_to_text_R-Precision, text_to_image_mAP@R, text_to_image_R-Precision.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from topoclip.data.types import RetrievalSet
from topoclip.run.evaluation.metrics import DEFAULT_KS, RetrievalAccumulator
from topoclip.run.evaluation.zeroshot import embed_images, embed_texts, evaluating


def image_to_text(
    model, dataset: RetrievalSet, images: torch.Tensor, captions: torch.Tensor, chunk_size: int, ks=DEFAULT_KS
) -> dict[str, float]:
    """Image queries (those with ≥ 1 caption) against all captions -> RetrievalAccumulator.compute()."""
    num_images, num_captions = images.shape[0], captions.shape[0]
    caption_index = torch.arange(num_captions)
    has_caption = torch.bincount(dataset.caption_image, minlength=num_images) > 0  # (N,)
    queries = has_caption.nonzero().squeeze(1)  # (Q,)
    accumulator = RetrievalAccumulator(ks)
    for start in range(0, queries.shape[0], chunk_size):
        image_index = queries[start : start + chunk_size]  # (q,)
        scores = model.similarity(images[image_index.to(images.device)], captions)  # (q, T)
        accumulator.update(
            scores, dataset.relevant(image_index, caption_index), dataset.paired(image_index, caption_index)
        )
    return accumulator.compute()


def text_to_image(
    model, dataset: RetrievalSet, images: torch.Tensor, captions: torch.Tensor, chunk_size: int, ks=DEFAULT_KS
) -> dict[str, float]:
    """Every caption as a query against all images -> RetrievalAccumulator.compute()."""
    num_images, num_captions = images.shape[0], captions.shape[0]
    image_index = torch.arange(num_images)
    accumulator = RetrievalAccumulator(ks)
    for start in range(0, num_captions, chunk_size):
        caption_index = torch.arange(start, min(start + chunk_size, num_captions))  # (q,)
        scores = model.similarity(captions[start : start + chunk_size], images)  # (q, N)
        # The data set answers (image, caption) questions; transpose to caption rows.
        accumulator.update(
            scores, dataset.relevant(image_index, caption_index).T, dataset.paired(image_index, caption_index).T
        )
    return accumulator.compute()


def evaluate_retrieval(
    model,
    tokenizer,
    dataset: RetrievalSet,
    image_transform: Callable[[Any], torch.Tensor],
    batch_size: int = 256,
    chunk_size: int = 1024,
    device="cpu",
    ks: Sequence[int] = DEFAULT_KS,
    workers: int = 0,
) -> dict[str, float]:
    """Embed all images (in `workers` decoding processes; see zeroshot.image_embedding_batches) and captions, then
    score both directions in chunks of `chunk_size` queries.

    Returns the keys listed in the module docstring, in percent.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be ≥ 1; got {chunk_size}")
    if dataset.caption_image.shape[0] != len(dataset.captions):
        raise ValueError(f"{dataset.name}: {dataset.caption_image.shape[0]} caption_image entries for {len(dataset.captions)} captions")
    images = embed_images(model, dataset.images, image_transform, batch_size, device, workers)  # (N, m, n)
    captions = embed_texts(model, tokenizer, dataset.captions, batch_size, device)  # (T, m, n)
    with evaluating(model):
        to_text = image_to_text(model, dataset, images, captions, chunk_size, ks)
        to_image = text_to_image(model, dataset, images, captions, chunk_size, ks)

    result: dict[str, float] = {}
    for k in ks:
        result[f"image_retrieval_recall@{k}"] = to_image[f"R@{k}"]
    for k in ks:
        result[f"text_retrieval_recall@{k}"] = to_text[f"R@{k}"]
    result["mean_recall"] = (to_image["mean_recall"] + to_text["mean_recall"]) / 2
    for direction, values in (("image_to_text", to_text), ("text_to_image", to_image)):
        result[f"{direction}_mAP@R"] = values["mAP@R"]
        result[f"{direction}_R-Precision"] = values["R-Precision"]
    return result
