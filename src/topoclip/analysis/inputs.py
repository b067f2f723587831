"""What the analyses start from: a trained model, and the built-in evaluation pairs it encodes.

- :func:`load_model` takes a run folder (its newest checkpoint), a checkpoint folder or a
  ``model.safetensors`` file and returns the model in eval mode on the chosen device, with its
  tokenizer, config and where it came from.
- :func:`scene_pairs` / :func:`encode_pairs`: N images of a built-in scenes split (test unless told), each with
  its own clean caption (one caption per image), in-domain or in the out-of-domain rendering
  style, and their embeddings (N, m, n). Text i is image i's positive; every other text is a
  negative. The scenes settings come from the model's config (defaults when it trained on other data).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


import torch

from topoclip.io.checkpoint import resolve_checkpoint
from topoclip.config import Config, ConfigError
from topoclip.data.types import RetrievalSet
from topoclip.core.errors import resolve_device
from topoclip.run.evaluation.zeroshot import embed_images, embed_texts
from topoclip.run.inference import Pretrained, load_folder
from topoclip.io.run_folder import METRICS, RunFolder

STYLES = ("in-domain", "out-of-domain")


def load_model(path, device: str = "auto") -> Pretrained:
    """A run folder, checkpoint folder or weights file -> Pretrained with its tokenizer (eval mode, on `device`)."""
    loaded = load_folder(Path(path), resolve_device(device, "--device"))
    if loaded.tokenizer is None:
        raise ConfigError(f"{loaded.checkpoint} has no tokenizer.json; the analyses need it to encode captions")
    return loaded


def find_run_folder(path) -> Path:
    """A run folder (with metrics.jsonl) from itself or from one of its checkpoints."""
    path = Path(path)
    if RunFolder(path).metrics.is_file():
        return path
    if path.is_dir():
        try:
            owner = RunFolder.of_checkpoint(resolve_checkpoint(path))
        except FileNotFoundError:
            owner = None
        if owner is not None and owner.metrics.is_file():
            return owner.path
    raise FileNotFoundError(f"{path} is not a run folder: expected {METRICS} there (made by `topoclip train`)")


# --------------------------------------------------------------------------- the built-in pairs


def scene_pairs(config: Config, size: int, style: str = "in-domain", split: str = "test") -> RetrievalSet:
    """`size` scenes of `split` with one clean caption each (caption i belongs to image i)."""
    from topoclip.data.scenes import retrieval_set

    if style not in STYLES:
        raise ConfigError(f"style {style!r} is unknown; choose one of {list(STYLES)}")
    scenes = config.data.scenes
    available = scenes.size_of(split)
    if not 1 <= size <= available:
        raise ConfigError(f"--size {size}: the built-in {split} split has {available} scenes; pick 1 … {available}")
    # The rendering style is relative to the config's own (a model trained out-of-domain has that as its domain).
    rendering = scenes.style if style == "in-domain" else ("out-of-domain" if scenes.style == "in-domain" else "in-domain")
    return retrieval_set(scenes, split, size, captions_per_image=1, style=rendering)


@dataclass
class EncodedPairs:
    """N image–caption pairs of one domain and their embeddings on the model's space."""

    domain: str  # "in-domain" or "out-of-domain"
    pairs: RetrievalSet  # images, captions (caption i belongs to image i)
    images: torch.Tensor  # (N, m, n) image embeddings
    texts: torch.Tensor  # (N, m, n) caption embeddings; row i is image i's positive


def encode_pairs(loaded: Pretrained, size: int, style: str = "in-domain", batch_size: int = 256,
                 split: str = "test") -> EncodedPairs:
    """Render and encode the first `size` pairs of the built-in scenes' `split` in `style`."""
    pairs = scene_pairs(loaded.config, size, style, split)
    images = embed_images(loaded.model, pairs.images, loaded.transform, batch_size, loaded.device)
    texts = embed_texts(loaded.model, loaded.tokenizer, pairs.captions, batch_size, loaded.device)
    return EncodedPairs(style, pairs, images, texts)
