"""The loss landscape around a trained model, at a low and a high τ.

- **Plane**: L(θ + α·d₁ + β·d₂; τ) for α, β on a K × K grid in [−r, r] (K odd, so the centre is
  exactly the trained weights θ), at τ = 1 and τ = 100 by default, drawn as contours.
- **Gradient norm along a line**: ‖∇_θ L(θ + α·d₁; τ)‖ for α on the line, for τ on a grid.

d₁, d₂ are random directions, **filter-normalised** (Li et al., 2018): Gaussian per weight tensor,
each filter (slice along the first dimension) rescaled to the norm of the same filter of θ, so a
step of 1 moves every filter by its own size; one-dimensional tensors (biases, LayerNorm) get a
zero direction, and the temperature is not a direction (τ is the variable set explicitly). The
loss is the model's training loss (``train.loss``; the sigmoid loss with its learned β; MERU's entailment term with
its weight, for a hyperbolic model) on a fixed batch: the first b pairs of the built-in test split with their clean
captions.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.func import functional_call

from topoclip.analysis.inputs import scene_pairs
from topoclip.analysis.output import pyplot, save_figure, write_json
from topoclip.config import ConfigError
from topoclip.run.inference import Pretrained
from topoclip.core.losses import get_loss

PLANE_SCALES = (1.0, 100.0)
GRADIENT_SCALES = (1.0, 3.0, 10.0, 30.0, 100.0)

# f(the forward's CLIPOutput, its similarity (b, b), τ 0-d) -> 0-d loss
LossOfSimilarity = Callable[[object, torch.Tensor, torch.Tensor], torch.Tensor]


def trainable_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights a direction moves: every parameter except the temperature's (t and β)."""
    return {name: p for name, p in model.named_parameters() if not name.startswith("temperature.")}


def filter_normalized_direction(weights: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A random direction whose every filter has the norm of the weights' filter (1-d tensors: zero)."""
    direction = {}
    for name, weight in weights.items():
        if weight.dim() <= 1:
            direction[name] = torch.zeros_like(weight)
            continue
        noise = torch.randn(weight.shape, generator=generator).to(weight.device, weight.dtype)
        filters = noise.flatten(1)  # (filters, rest)
        target = weight.detach().flatten(1).norm(dim=1, keepdim=True)  # (filters, 1)
        direction[name] = (filters * target / filters.norm(dim=1, keepdim=True).clamp_min(1e-12)).view_as(weight)
    return direction


def shifted(weights: dict, directions: Sequence[dict], coefficients: Sequence[float]) -> dict[str, torch.Tensor]:
    """θ + Σ_k c_k·d_k, tensor by tensor (detached)."""
    out = {}
    for name, weight in weights.items():
        value = weight.detach()
        for direction, coefficient in zip(directions, coefficients):
            value = value + coefficient * direction[name]
        out[name] = value
    return out


def model_loss_function(loaded: Pretrained) -> LossOfSimilarity:
    """The run's training loss as f(output, similarity, τ) (with the learned β for the sigmoid loss, and the entailment
    term of train.entailment_weight)."""
    from topoclip.core.losses import loss_keywords

    loss, keywords = get_loss(loaded.config.train.loss), loss_keywords(loaded.config)
    bias = loaded.model.temperature.bias
    bias = None if bias is None else bias.detach()
    weight, model = loaded.config.train.entailment_weight, loaded.model

    def training_loss(output, similarity: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        value = loss(similarity, similarity.T, scale, bias, **keywords)
        if weight:
            value = value + weight * model.entailment(output.text_embeds, output.image_embeds, output.curvature)
        return value

    return training_loss


def batch_losses(model, weights: dict, pixels: torch.Tensor, text, scales: Sequence[float],
                 loss: LossOfSimilarity) -> torch.Tensor:
    """The loss on the batch with `weights` swapped into `model`, at each τ -> (T,)."""
    output = functional_call(model, weights, args=(pixels, text))
    # (b, b), independent of τ; a hyperbolic model's c is the swapped weights' (the forward's), not the model's own
    similarity = model.similarity(output.image_embeds, output.text_embeds, curvature=output.curvature)
    return torch.stack([loss(output, similarity, torch.tensor(float(s), device=similarity.device)) for s in scales])


def loss_plane(model, pixels, text, directions: Sequence[dict], coordinates: Sequence[float], scales: Sequence[float],
               loss: LossOfSimilarity) -> torch.Tensor:
    """(T, K, K) loss at θ + coordinates[i]·d₁ + coordinates[j]·d₂ for each τ (row i = α, column j = β)."""
    weights = trainable_weights(model)
    plane = torch.empty(len(scales), len(coordinates), len(coordinates))
    with torch.no_grad():
        for i, alpha in enumerate(coordinates):
            for j, beta in enumerate(coordinates):
                point = shifted(weights, directions, (alpha, beta))
                plane[:, i, j] = batch_losses(model, point, pixels, text, scales, loss).cpu()
    return plane


def gradient_norms(model, pixels, text, direction: dict, coordinates: Sequence[float], scales: Sequence[float],
                   loss: LossOfSimilarity) -> torch.Tensor:
    """(T, K) ‖∇_θ L(θ + coordinates[k]·d; τ)‖₂ over every moved weight, for each τ."""
    weights = trainable_weights(model)
    norms = torch.empty(len(scales), len(coordinates))
    for k, alpha in enumerate(coordinates):
        point = {name: value.requires_grad_() for name, value in shifted(weights, [direction], [alpha]).items()}
        with torch.enable_grad():
            losses = batch_losses(model, point, pixels, text, scales, loss)
            for t in range(len(scales)):
                grads = torch.autograd.grad(losses[t], list(point.values()), retain_graph=t < len(scales) - 1,
                                            allow_unused=True)
                norms[t, k] = torch.sqrt(sum((g.float() ** 2).sum() for g in grads if g is not None)).item()
    return norms


def plot_landscape(result: dict, out_dir):
    """landscape.png: one contour panel per plane τ, then the gradient norms along the line."""
    plt = pyplot()
    planes = result["planes"]
    figure, axes = plt.subplots(1, len(planes) + 1, figsize=(4.8 * (len(planes) + 1), 4.2))
    coordinates = result["coordinates"]
    for axis, plane in zip(axes, planes):
        grid = torch.as_tensor(plane["loss"])
        contours = axis.contourf(coordinates, coordinates, grid.T.numpy(), levels=20, cmap="viridis")
        axis.contour(coordinates, coordinates, grid.T.numpy(), levels=20, colors="white", linewidths=0.3)
        figure.colorbar(contours, ax=axis)
        axis.plot([0], [0], "r+", markersize=10)
        axis.set_title(f"loss at τ = {plane['scale']:g} (+ = trained weights)", fontsize=9)
        axis.set_xlabel("α (direction 1)")
        axis.set_ylabel("β (direction 2)")
    line = axes[-1]
    gradient = result["gradient"]
    for scale, norms in zip(gradient["scales"], gradient["norms"]):
        line.plot(gradient["coordinates"], norms, marker="o", markersize=3, label=f"τ = {scale:g}")
    line.set_yscale("log")
    line.set_xlabel("α along direction 1")
    line.set_ylabel("‖∇θ L‖")
    line.set_title("gradient norm along a random direction", fontsize=9)
    line.legend(fontsize=8)
    line.grid(alpha=0.3)
    figure.tight_layout()
    return save_figure(figure, out_dir, "landscape")


def analyze_landscape(loaded: Pretrained, out_dir, batch_size: int = 64, resolution: int = 15, radius: float = 1.0,
                      plane_scales: Sequence[float] = PLANE_SCALES, gradient_scales: Sequence[float] = GRADIENT_SCALES,
                      gradient_points: int = 9, seed: int = 0) -> dict:
    """Compute the planes and the gradient norms, write landscape.png and landscape.json."""
    if resolution < 3 or resolution % 2 == 0:
        raise ConfigError(f"--resolution {resolution} must be odd and ≥ 3 (the grid's centre is the trained model)")
    if gradient_points < 1 or batch_size < 2:
        raise ConfigError("--gradient-points must be ≥ 1 and --batch-size ≥ 2")
    model = loaded.model
    pairs = scene_pairs(loaded.config, batch_size)
    pixels = loaded.pixels(pairs.images)
    text = loaded.tokenizer(pairs.captions).to(loaded.device)
    loss = model_loss_function(loaded)
    generator = torch.Generator().manual_seed(seed)
    weights = trainable_weights(model)
    directions = [filter_normalized_direction(weights, generator) for _ in range(2)]
    coordinates = torch.linspace(-radius, radius, resolution).tolist()
    coordinates[resolution // 2] = 0.0  # exactly the trained weights at the centre
    plane = loss_plane(model, pixels, text, directions, coordinates, plane_scales, loss)
    line = torch.linspace(-radius, radius, gradient_points).tolist()
    norms = gradient_norms(model, pixels, text, directions[0], line, gradient_scales, loss)
    result = {"analysis": "landscape", "model": loaded.name, "checkpoint": str(loaded.checkpoint),
              "topology": model.config.topology, "loss": loaded.config.train.loss,
              "entailment_weight": loaded.config.train.entailment_weight,  # MERU's term, part of the loss drawn
              "model_scale": model.temperature.scale.item(), "batch_size": batch_size, "seed": seed,
              "coordinates": coordinates,
              "planes": [{"scale": s, "loss": plane[t].tolist(), "loss_at_origin": plane[t, resolution // 2, resolution // 2].item()}
                         for t, s in enumerate(plane_scales)],
              "gradient": {"scales": list(gradient_scales), "coordinates": line, "norms": norms.tolist()}}
    result["plots"] = [plot_landscape(result, out_dir).name]
    write_json(out_dir, "landscape", result)
    return result
