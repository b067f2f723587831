"""Grad-CAM of the image–text matching score on image patches and text tokens (paper §4.5, Fig. 5).

For one image–caption pair the scores explained are the total similarity s(u, v) and, for product
spheres, each class-token pair's (sub-sphere's) score u_kᵀv_k (for ps-inner they sum to s). Grad-CAM
(Selvaraju et al., 2017) on a transformer: take the token activations A (tokens, width) at the
input of one block (default the last: the output of the second-to-last block — the last block
computes only the class tokens), the gradient G = ∂score/∂A, channel weights w = mean over the
tokens of G, and the map ReLU(A·w) over the tokens:

- image: over the grid² patch tokens -> (grid, grid), drawn over the image;
- text: over the caption's tokens as the tower sees them (``model.text.pooling`` inserts the m − 1
  extra class or end-of-text tokens; padding is left out, and so are the m − 1 extra leading
  [CLS] copies of the class-token layout, identical to the caption's own [CLS]) -> (L,), drawn as
  coloured tokens (the paper's token-wise extension).
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from topoclip.analysis.inputs import scene_pairs
from topoclip.analysis.output import pyplot, save_figure, write_json
from topoclip.core.geometry import get_topology
from topoclip.config import ConfigError
from topoclip.core.errors import UserError
from topoclip.run.inference import Pretrained


@dataclass
class GradCAM:
    """The maps of one pair, one row per explained score (the total first, then pair 0 … m − 1)."""

    caption: str
    tokens: list[str]  # L tokens of the caption
    score_names: list[str]  # P names: "total", "pair 0", …
    scores: torch.Tensor  # (P,)
    image_maps: torch.Tensor  # (P, grid, grid), ≥ 0
    text_maps: torch.Tensor  # (P, L), ≥ 0
    # The share of the image's side the patches read (grid · patch / image size): below 1 when the image size is past
    # a multiple of the patch size, whose last pixels no patch reads.
    coverage: float = 1.0


def cam(activations: torch.Tensor, gradients: torch.Tensor) -> torch.Tensor:
    """Grad-CAM over tokens: activations, gradients (T, width) -> (T,) = ReLU(A · mean_T(G))."""
    return F.relu(activations @ gradients.mean(dim=0))


class _BlockInput:
    """Records the input tokens (B, L, width) of a transformer block on each forward."""

    def __init__(self, block: torch.nn.Module):
        self.value: Optional[torch.Tensor] = None
        self.handle = block.register_forward_pre_hook(self._record)

    def _record(self, module, args):
        self.value = args[0]

    def remove(self) -> None:
        self.handle.remove()


def pair_scores(model, u: torch.Tensor, v: torch.Tensor) -> tuple[list[str], torch.Tensor]:
    """u, v (1, m, n) -> (names, (P,) scores): the total, then each factor's u_kᵀv_k for product spheres (−d(u_k, v_k)
    on product hyperboloids)."""
    total = model.similarity(u, v)[0, 0]
    if not get_topology(model.config.topology).product:
        return ["total"], total[None]
    if model.curvature is not None:
        per_pair = torch.stack([model.similarity(u[:, k : k + 1], v[:, k : k + 1])[0, 0] for k in range(u.shape[1])])
    else:
        per_pair = (u[0].float() * v[0].float()).sum(-1)  # (m,)
    return ["total"] + [f"pair {k}" for k in range(per_pair.shape[0])], torch.cat([total[None], per_pair])


def text_positions(model, batch, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids (T,) the text tower's blocks see for a one-caption batch, and the positions to explain.

    T = `length`, the sequence the hook saw (the tower drops trailing padding). Positions: every
    non-padding one, less the m − 1 extra leading [CLS] copies of the class-token layout.
    """
    ids, mask = model.text.pooling.insert(batch.input_ids, batch.attention_mask)  # (1, L + m − 1)
    ids, mask = ids[0, :length].cpu(), mask[0, :length].cpu()
    if model.config.text.pooling == "class_tokens":
        mask[: model.text.class_tokens - 1] = False
    return ids, mask.nonzero().squeeze(1)


def grad_cam(model, tokenizer, pixels: torch.Tensor, caption: str, layer: int = -1) -> GradCAM:
    """Grad-CAM of every score of one pair. pixels: (1, 3, S, S) normalised, on the model's device."""
    blocks = [model.visual.transformer.resblocks, model.text.transformer.resblocks]
    for stack in blocks:
        if not -len(stack) <= layer < len(stack):
            raise ConfigError(f"--layer {layer}: the towers have {len(blocks[0])} image and {len(blocks[1])} text "
                              f"blocks; pick an index that exists in both (default −1, the last)")
    image_input, text_input = _BlockInput(blocks[0][layer]), _BlockInput(blocks[1][layer])
    batch = tokenizer([caption]).to(pixels.device)
    try:
        with torch.enable_grad():
            u = model.encode_image(pixels)
            v = model.encode_text(batch)
            names, scores = pair_scores(model, u, v)
            image_tokens, text_tokens = image_input.value, text_input.value  # (1, [m +] grid², w), (1, T, w)
            ids, positions = text_positions(model, batch, text_tokens.shape[1])
            image_maps, text_maps = [], []
            patches = 0 if model.visual.attention_pooling else model.visual.class_tokens  # where the patches start
            for p in range(len(names)):
                image_grad, text_grad = torch.autograd.grad(scores[p], [image_tokens, text_tokens], retain_graph=True)
                image_maps.append(cam(image_tokens[0, patches:].detach().float(), image_grad[0, patches:].float()))
                text_maps.append(cam(text_tokens[0, positions].detach().float(), text_grad[0, positions].float()))
    finally:
        image_input.remove()
        text_input.remove()
    vision = model.config.vision
    grid = vision.image_size // vision.patch_size
    tokens = [tokenizer.decode([i], skip_special_tokens=False) for i in ids[positions].tolist()]
    return GradCAM(caption, tokens, names, scores.detach().cpu(),
                   torch.stack(image_maps).view(len(names), grid, grid).cpu(), torch.stack(text_maps).cpu(),
                   grid * vision.patch_size / vision.image_size)


def _normalised(values: torch.Tensor) -> np.ndarray:
    top = values.max().item()
    return (values / top).numpy() if top > 0 else values.numpy()


def _draw_tokens(axis, tokens: Sequence[str], weights: np.ndarray, colormap) -> None:
    """Tokens left to right, wrapped, each on a background coloured by its weight in [0, 1]."""
    axis.set_axis_off()
    x, y, per_line = 0.0, 0.85, 22.0  # characters per line of the panel
    for token, weight in zip(tokens, weights):
        width = (len(token) + 1) / per_line
        if x + width > 1.0 and x > 0:
            x, y = 0.0, y - 0.3
        axis.text(x, y, token, fontsize=7, family="monospace", va="top", transform=axis.transAxes,
                  bbox={"facecolor": colormap(float(weight)), "edgecolor": "none", "pad": 1.0, "alpha": 0.8})
        x += width


def plot_maps(results: Sequence[GradCAM], images: Sequence[np.ndarray], out_dir, pairs_shown: int = 4):
    """gradcam.png: per example, the image, the total score's map and the `pairs_shown` highest-scoring pairs."""
    plt = pyplot()
    colormap = plt.get_cmap("jet")
    columns = 1 + min(len(results[0].score_names), 1 + pairs_shown)
    figure = plt.figure(figsize=(2.3 * columns, 3.1 * len(results)))
    grid = figure.add_gridspec(2 * len(results), columns, height_ratios=[3, 1] * len(results))
    for row, (result, image) in enumerate(zip(results, images)):
        order = [0] + [1 + int(k) for k in torch.argsort(result.scores[1:], descending=True)[:pairs_shown]]
        axis = figure.add_subplot(grid[2 * row, 0])
        axis.imshow(image)
        axis.set_title("input", fontsize=8)
        axis.set_axis_off()
        caption_axis = figure.add_subplot(grid[2 * row + 1, 0])
        caption_axis.set_axis_off()
        caption_axis.text(0, 0.9, textwrap.fill(result.caption, 30), fontsize=7, va="top", transform=caption_axis.transAxes)
        height, width = image.shape[:2]
        read = (max(1, round(height * result.coverage)), max(1, round(width * result.coverage)))  # the patches' part
        for column, index in enumerate(order, start=1):
            axis = figure.add_subplot(grid[2 * row, column])
            axis.imshow(image)
            heat = F.interpolate(result.image_maps[index][None, None], size=read, mode="bilinear",
                                 align_corners=False)[0, 0]
            heat = F.pad(heat, (0, width - read[1], 0, height - read[0]))  # no heat where no patch reads
            axis.imshow(_normalised(heat), cmap=colormap, alpha=0.5, vmin=0, vmax=1)
            axis.set_title(f"{result.score_names[index]}: {result.scores[index].item():.2f}", fontsize=8)
            axis.set_axis_off()
            _draw_tokens(figure.add_subplot(grid[2 * row + 1, column]), result.tokens,
                         _normalised(result.text_maps[index]), colormap)
    figure.tight_layout()
    return save_figure(figure, out_dir, "gradcam")


def load_images(paths: Sequence) -> list[np.ndarray]:
    """Image files -> uint8 (H, W, 3) arrays (read as training reads them: data.images.decode_image)."""
    from topoclip.data.images import decode_image
    from topoclip.data.quality import BadSample

    arrays = []
    for path in paths:
        try:
            arrays.append(np.asarray(decode_image(Path(path))))
        except BadSample as error:
            raise UserError(f"--image {path}: {error}") from None
    return arrays


def analyze_gradcam(loaded: Pretrained, out_dir, examples: int = 4, image_files: Sequence = (),
                    captions: Sequence[str] = (), layer: int = -1, pairs_shown: int = 4) -> dict:
    """Grad-CAM of the first `examples` built-in test pairs (or of the given image files and captions)."""
    if image_files or captions:
        if len(image_files) != len(captions):
            raise ConfigError(f"give one --caption per --image (got {len(image_files)} images, {len(captions)} captions)")
        images, texts = load_images(image_files), list(captions)
    else:
        pairs = scene_pairs(loaded.config, examples)
        images, texts = list(pairs.images), list(pairs.captions)
    results = [grad_cam(loaded.model, loaded.tokenizer, loaded.pixels([image]), text, layer)
               for image, text in zip(images, texts)]
    result = {"analysis": "gradcam", "model": loaded.name, "checkpoint": str(loaded.checkpoint), "layer": layer,
              "examples": [{"caption": r.caption, "tokens": r.tokens, "score_names": r.score_names, "scores": r.scores,
                            "image_maps": r.image_maps, "text_maps": r.text_maps} for r in results]}
    result["plots"] = [plot_maps(results, images, out_dir, pairs_shown).name]
    write_json(out_dir, "gradcam", result)
    return result
