"""Use a trained model: load it, embed images and texts, classify images, retrieve.

    clip = topoclip.load("runs/cpu-multi-…")           # a run folder, checkpoint or exported folder,
                                                       # or a Hugging Face Hub repo id ("org/name")
    model, tokenizer, transform = clip                 # it is also a plain 3-tuple
    clip.encode_image([Path("cat.jpeg")])              # (1, m, n) on the model's space
    clip.classify([Path("cat.jpeg")], ["cat", "dog"])  # (1, 2) probabilities
    clip.retrieve("a red circle", images, top_k=5)     # (scores, indices), each (1, 5)

Images are PIL images, uint8 arrays (H, W, 3), paths (``pathlib.Path``; a plain string is a
text), or float tensors (B, 3, H, W) already transformed. Everything runs on the model's device
(``load(..., device="cuda")``).

Hub repositories hold the exported layout (``model.safetensors``, ``topoclip_config.json`` — or
``config.json`` in repositories pushed before — and ``tokenizer.json``) and are read through ``huggingface_hub`` (``pip install "topoclip[hub]"``),
which keeps a local cache: with ``HF_HUB_OFFLINE=1`` they load from the cache alone.
"""
from __future__ import annotations

import re
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

import numpy as np
import torch
from PIL import Image

from topoclip.io.checkpoint import load_checkpoint, resolve_checkpoint
from topoclip.config import Config
from topoclip.core.errors import UserError, resolve_device
from topoclip.run.evaluation.zeroshot import ZeroShotClassifier, evaluating, zero_shot_classifier
from topoclip.model.clip import CLIP
from topoclip.io.pretrained import PRETRAINED, hub_folder, pretrained_folder
from topoclip.preprocess.tokenizer import Tokenizer
from topoclip.io.run_folder import RunFolder
from topoclip.preprocess.transforms import eval_transform

HUB_PREFIX = "hf-hub:"  # forces a Hub lookup even when a local folder of that name exists
HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
DEFAULT_TEMPLATES = ("a photo of a {}.",)  # CLIP's single prompt

ImageInput = Union[Image.Image, np.ndarray, Path, torch.Tensor]


@dataclass(frozen=True, eq=False)
class Pretrained:
    """A loaded model with its tokenizer and evaluation image transform (unpacks as that 3-tuple), and
    where it came from: its config, checkpoint folder and run folder (None when not known)."""

    model: CLIP
    tokenizer: Optional[Tokenizer]
    transform: Callable
    config: Optional[Config] = None
    checkpoint: Optional[Path] = None
    run_dir: Optional[Path] = None

    def __iter__(self) -> Iterator:
        return iter((self.model, self.tokenizer, self.transform))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def name(self) -> str:
        """A label for plots and result files: the run folder's name, else the checkpoint's."""
        return (self.run_dir or self.checkpoint or Path("model")).name

    def pixels(self, images: Union[ImageInput, Sequence[ImageInput]]) -> torch.Tensor:
        """Images -> (B, 3, H, W) float on the model's device, through the evaluation transform.

        A uint8 array (B, H, W, 3) is B images; (H, W, 3) is one.
        """
        if isinstance(images, torch.Tensor) and images.is_floating_point():
            return (images[None] if images.dim() == 3 else images).to(self.device)
        if isinstance(images, np.ndarray) and images.ndim == 4:
            images = list(images)
        if isinstance(images, (Image.Image, np.ndarray, Path, torch.Tensor)):
            images = [images]
        if isinstance(images, str) or any(isinstance(image, str) for image in images):
            raise TypeError("a plain string is a text; pass image files as pathlib.Path (or PIL images)")
        return torch.stack([self.transform(_open(image)) for image in images]).to(self.device)

    def encode_image(self, images, batch_size: int = 64, flat: bool = False) -> torch.Tensor:
        """Images -> (B, m, n) fp32 embeddings on the model's space; flat: (B, m·n) (see CLIP.flatten)."""
        pixels = self.pixels(images)
        with evaluating(self.model):
            return torch.cat([self.model.encode_image(pixels[i:i + batch_size], flat=flat)
                              for i in range(0, len(pixels), batch_size)])

    def encode_text(self, texts: Union[str, Sequence[str]], batch_size: int = 256, flat: bool = False) -> torch.Tensor:
        """Texts -> (B, m, n) fp32 embeddings on the model's space; flat: (B, m·n) (see CLIP.flatten)."""
        tokenizer = self._require_tokenizer()
        texts = [texts] if isinstance(texts, str) else list(texts)
        with evaluating(self.model):
            return torch.cat([self.model.encode_text(tokenizer(texts[i:i + batch_size]).to(self.device), flat=flat)
                              for i in range(0, len(texts), batch_size)])

    def zero_shot_classifier(self, classnames: Sequence[str], templates: Sequence[str] = DEFAULT_TEMPLATES,
                             mode: str = "distance") -> ZeroShotClassifier:
        """Class prompts (each template with "{}" for the name) -> a classifier; see evaluation.zeroshot."""
        return zero_shot_classifier(self.model, self._require_tokenizer(), list(classnames), list(templates), mode,
                                    device=self.device)

    def classify(self, images, classnames: Union[Sequence[str], ZeroShotClassifier],
                 templates: Sequence[str] = DEFAULT_TEMPLATES, mode: str = "distance") -> torch.Tensor:
        """Images, class names (or a ready classifier) -> (B, C) probabilities, softmax(τ · scores)."""
        classifier = classnames if isinstance(classnames, ZeroShotClassifier) else \
            self.zero_shot_classifier(classnames, templates, mode)
        images = self.encode_image(images)
        # no_grad, not inference mode: a hyperbolic similarity reads the learned curvature (no graph kept), and the
        # result stays a plain tensor (edited in place, a target of a loss)
        with torch.no_grad():
            return (self.model.temperature.scale * classifier.scores(self.model, images)).softmax(dim=-1)  # (B, C)

    def retrieve(self, query, gallery, top_k: int = 5) -> torch.return_types.topk:
        """The `top_k` gallery items most similar to each query -> (values, indices), each (Q, k).

        query and gallery: texts (str or list of str), images, or embeddings (N, m, n) already made.
        """
        queries, items = self._embed(query), self._embed(gallery)
        with torch.no_grad():  # as classify's
            return self.model.similarity(queries, items).topk(min(top_k, items.shape[0]), dim=1)  # (Q, G)

    def _embed(self, things) -> torch.Tensor:
        shape = tuple(self.model.embedding_shape)
        if isinstance(things, torch.Tensor) and things.is_floating_point() and tuple(things.shape[1:]) == shape:
            return things.to(self.device)
        if isinstance(things, str) or (isinstance(things, (list, tuple)) and things and isinstance(things[0], str)):
            return self.encode_text(things)
        return self.encode_image(things)

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise UserError("this checkpoint has no tokenizer.json, so it cannot read text; convert it again with "
                            "--vocab (the model's vocabulary file)")
        return self.tokenizer


def _open(image):
    """A path -> RGB PIL image (one clear error for a missing or unreadable file); others as given."""
    if not isinstance(image, Path):
        return image
    from topoclip.data.images import decode_image
    from topoclip.data.quality import BadSample

    try:
        return decode_image(image)
    except BadSample as error:
        raise UserError(f"cannot read image {image}: {error}") from None


def checkpoint_folder(source: Union[str, Path], revision: Optional[str] = None,
                      cache_dir: Optional[Union[str, Path]] = None) -> Path:
    """A local folder for `source`: itself when it exists, a pretrained name's converted folder ("ViT-B-32:openai",
    topoclip.io.pretrained), else the Hub snapshot of a repo id ("org/name", or "hf-hub:org/name" to skip the local
    lookup)."""
    text = str(source)
    if text in PRETRAINED and not Path(source).exists():
        return pretrained_folder(text, revision)
    if text.startswith(HUB_PREFIX):
        return hub_folder(text.removeprefix(HUB_PREFIX), revision, cache_dir)
    if not Path(source).exists() and HUB_REPO_ID.match(text):
        first = text.split("/")[0]
        if Path(first).is_dir():  # `runs/x`: a local path is meant; the Hub is not asked (nor told the path)
            raise FileNotFoundError(f"{text}: no such folder ({first}/ exists here, so it is read as a local path; "
                                    f"for the Hugging Face Hub repo write {HUB_PREFIX}{text})")
        try:
            return hub_folder(text, revision, cache_dir)
        except UserError as error:  # maybe a mistyped local path: say both readings
            raise type(error)(f"no local folder {text!r}, and as a Hugging Face Hub repo: {error}") from None
    if not Path(source).exists():
        raise FileNotFoundError(f"{text}: no such file or folder (nor a Hub repo id like org/name)")
    return Path(source)


def load(source: Union[str, Path], device: str = "cpu", revision: Optional[str] = None,
         cache_dir: Optional[Union[str, Path]] = None) -> Pretrained:
    """(model in eval mode on `device`, tokenizer or None, image transform) from a local run folder (its
    newest checkpoint), checkpoint or exported folder, a transformers CLIPModel folder, a model.safetensors file,
    a Hugging Face Hub repo id ("org/name" or "hf-hub:org/name"), or a pretrained name ("ViT-B-32:openai", see
    `topoclip pretrained`)."""
    return load_folder(checkpoint_folder(source, revision, cache_dir), resolve_device(device))


def load_folder(path: Path, device: torch.device) -> Pretrained:
    """A local run folder, checkpoint folder, weights file or transformers CLIPModel folder -> Pretrained on
    `device`, in eval mode."""
    try:
        folder = resolve_checkpoint(path)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"{error}; foreign weights (OpenAI, OpenCLIP, the authors' release) are read "
                                f"with `topoclip convert --from FORMAT SRC DST` first") from None
    model, tokenizer, config = load_checkpoint(folder, map_location=str(device))
    vision = config.model.vision
    transform = eval_transform(vision.image_size, vision.mean, vision.std, resize=vision.eval_resize)
    owner = RunFolder.of_checkpoint(folder)
    return Pretrained(model.eval(), tokenizer, transform, config, folder, owner.path if owner else None)
