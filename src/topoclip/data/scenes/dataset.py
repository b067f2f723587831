"""`SceneDataset`: one split of the generated scenes, item i -> (image, its paired caption).

Decisions (tests rely on them):
- Sample i of a split is a pure function of (seed, split, i): its scene and image, its captions and
  (for a noisy pair) its donor each come from their own Generator keyed (seed, split stream, split, i,
  purpose), so DataLoader workers and any access order give the same bytes.
- Held-out compositions are excluded from the train and val splits (val mirrors training); the test
  split draws every composition.
- Noise: exactly round(p * train_size) train pairs (Python `round`) are noisy, chosen by a fixed
  permutation from the seed; a noisy pair's caption is the clean caption of a donor pair drawn from the
  seed whose caption is NOT true of the noisy pair's image (so it also differs from the clean caption).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
from torch.utils.data import Dataset

from .captions import Caption, sample_caption
from .config import SPLITS, SceneConfig, _CAPTION, _DONOR, _NOISE_STREAM, _SCENE, _SPLIT_STREAM, _check_split, _generator
from .layout import Scene, sample_scene
from .rendering import render_scene


class SceneDataset(Dataset):
    """Split `split` of the generated scenes: item i -> (image uint8 (S, S, 3) or transform(image), caption str)."""

    def __init__(self, config: SceneConfig, split: str = "train", transform: Optional[Callable] = None):
        config.validate()
        _check_split(split)
        self.config = config
        self.split = split
        self.transform = transform
        self._split_id = SPLITS.index(split)
        self._size = config.size_of(split)
        self._exclude_held_out = split in ("train", "val")
        self._noisy = np.zeros(self._size, dtype=bool)
        if split == "train" and config.noise > 0:
            chosen = _generator(config.seed, _NOISE_STREAM, 0, 0, 0).permutation(self._size)[: round(config.noise * self._size)]
            self._noisy[chosen] = True

    def __len__(self) -> int:
        return self._size

    def _index(self, i: int) -> int:
        i = int(i)
        if i < 0:
            i += self._size
        if not 0 <= i < self._size:
            raise IndexError(f"index {i} out of range for the {self.split} split of {self._size} samples")
        return i

    def _scene_and_rng(self, i: int) -> tuple[Scene, np.random.Generator]:
        rng = _generator(self.config.seed, _SPLIT_STREAM, self._split_id, i, _SCENE)
        return sample_scene(self.config, rng, exclude_held_out=self._exclude_held_out), rng

    def scene(self, i: int) -> Scene:
        """The structured scene of sample i (objects, their attributes and cells; `.relations`)."""
        return self._scene_and_rng(self._index(i))[0]

    def image(self, i: int) -> np.ndarray:
        """uint8 (S, S, 3) image of sample i (no transform)."""
        scene, rng = self._scene_and_rng(self._index(i))
        return render_scene(scene, rng)

    def annotated_captions_for(self, i: int, k: int = 5) -> list[Caption]:
        """k distinct true captions of sample i with their meaning; the first is its clean training caption."""
        i = self._index(i)
        scene = self.scene(i)
        rng = _generator(self.config.seed, _SPLIT_STREAM, self._split_id, i, _CAPTION)
        found: dict[str, Caption] = {}
        for _ in range(20 * k + 20):
            caption = sample_caption(scene, rng)
            found.setdefault(caption.text, caption)
            if len(found) == k:
                return list(found.values())
        raise ValueError(f"sample {i} of {self.split} yielded only {len(found)} distinct captions; ask for fewer than {k}")

    def captions_for(self, i: int, k: int = 5) -> list[str]:
        """k distinct true captions of sample i (for retrieval); the first is its clean training caption."""
        return [c.text for c in self.annotated_captions_for(i, k)]

    def clean_caption(self, i: int) -> Caption:
        """The caption written for sample i, before any noise."""
        i = self._index(i)
        return self._clean_caption(i, self.scene(i))

    def _clean_caption(self, i: int, scene: Scene) -> Caption:
        return sample_caption(scene, _generator(self.config.seed, _SPLIT_STREAM, self._split_id, i, _CAPTION))

    def paired_caption(self, i: int) -> Caption:
        """The caption sample i is trained with: the clean one, or for a noisy pair a donor's clean caption."""
        i = self._index(i)
        return self._paired_caption(i, self.scene(i))

    def _paired_caption(self, i: int, scene: Scene) -> Caption:
        if not self._noisy[i]:
            return self._clean_caption(i, scene)
        rng = _generator(self.config.seed, _SPLIT_STREAM, self._split_id, i, _DONOR)
        for _ in range(1000):
            donor = int(rng.integers(self._size - 1))
            donor += donor >= i  # never the pair itself
            caption = self.clean_caption(donor)
            if not caption.describes(scene):
                return caption
        raise RuntimeError(f"no donor caption found for noisy sample {i}; the scenes are too uniform for noise")

    @property
    def noisy_indices(self) -> np.ndarray:
        """(round(noise * train_size),) int64, sorted: the pairs whose caption was replaced (train only)."""
        return np.flatnonzero(self._noisy)

    def is_noisy(self, i: int) -> bool:
        """True when sample i is trained with another pair's caption."""
        return bool(self._noisy[self._index(i)])

    def __getitem__(self, i: int):
        i = self._index(i)
        scene, rng = self._scene_and_rng(i)
        image = render_scene(scene, rng)
        caption = self._paired_caption(i, scene).text
        return (self.transform(image) if self.transform is not None else image), caption

    def true_pairs(self, indices: Sequence[int]) -> np.ndarray:
        """(B, B) bool for a batch of samples: entry (j, k) is True when the caption sample j is trained with is
        true of the scene of sample k. The diagonal is False exactly for the noisy pairs; a True entry off it is
        a false negative of the contrastive losses (a caption and an image that the batch treats as unmatched)."""
        pairs = [(self.paired_caption(i), self.scene(i)) for i in indices]
        return np.array([[caption.describes(scene) for _, scene in pairs] for caption, _ in pairs], dtype=bool)

    def batch(self, indices: Sequence[int]) -> tuple[np.ndarray, list[str]]:
        """Untransformed images (B, S, S, 3) uint8 and their paired captions."""
        images = np.empty((len(indices), self.config.image_size, self.config.image_size, 3), np.uint8)
        captions = []
        for row, i in enumerate(indices):
            i = self._index(i)
            scene, rng = self._scene_and_rng(i)
            images[row] = render_scene(scene, rng)
            captions.append(self._paired_caption(i, scene).text)
        return images, captions
