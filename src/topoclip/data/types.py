"""The two evaluation-set shapes every data source produces (generated scenes, class folders, caption JSON)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

# An image as a data source hands it over: a PIL.Image (any mode) or a uint8 array (H, W, 3).
# Evaluation code converts it with the model's evaluation transform.


@dataclass
class ClassificationSet:
    """Zero-shot classification: N labelled images, C class names, prompt templates with one "{}"."""

    name: str
    images: Sequence  # N items, indexable
    labels: torch.Tensor  # (N,) int64 in [0, C)
    classnames: list[str]  # C names
    templates: list[str] = field(default_factory=lambda: ["a photo of a {}."])
    # How the set relates to training: "in-domain", "out-of-domain", "held-out" (classes never in the
    # training captions), "held-out, out-of-domain"; "" when unknown (the user's own sets).
    domain: str = ""


@dataclass
class RetrievalSet:
    """Retrieval: N images, T captions; each caption was written for one image (its paired positive).

    `relevance(image_index (k,), caption_index (j,)) -> (k, j) bool` says which pairs are semantically
    correct (for mAP@R and R-Precision); when None, only the paired captions count.
    """

    name: str
    images: Sequence  # N items
    captions: list[str]  # T captions
    caption_image: torch.Tensor  # (T,) int64: the image each caption belongs to
    relevance: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
    domain: str = ""  # as ClassificationSet.domain

    def paired(self, image_index: torch.Tensor, caption_index: torch.Tensor) -> torch.Tensor:
        """(k, j) bool: caption j was written for image k."""
        return self.caption_image[caption_index][None, :] == image_index[:, None]

    def relevant(self, image_index: torch.Tensor, caption_index: torch.Tensor) -> torch.Tensor:
        """(k, j) bool: semantic ground truth if known, else the pairing."""
        if self.relevance is None:
            return self.paired(image_index, caption_index)
        return self.relevance(image_index, caption_index)
