"""The equilibrium of InfoNCE's two terms as τ varies (the paper's §1, "Equilibrium").

For a batch of b pairs with similarities s_ij (image i, text j; s_ii the positives), the symmetric
InfoNCE loss splits exactly into an alignment and a uniformity term:

    alignment  A(τ) = (1/b) Σ_i −τ·s_ii
    uniformity U(τ) = ½ [ (1/b) Σ_i log Σ_j exp(τ·s_ij) + (1/b) Σ_j log Σ_i exp(τ·s_ij) ]
    loss = A + U,   ratio = A / U

(the two cross-entropies share the diagonal, so A is the same for both directions; U averages the
row-wise and column-wise log-sum-exp). A perfectly separable batch drives the loss to 0, i.e. the
ratio to −1; noise keeps it above.

The experiment: take the trained model's embeddings of N built-in test pairs (or the first N of the
training split, the scenes it trained on, each with its first clean caption), draw batches of b
pairs, give p % of the batch's images another batch member's caption (a derangement of the chosen
rows; at least 2 rows when p > 0), and evaluate the terms on a grid of τ. It also reports, for each
(b, p), τ* — the τ on the grid minimising the loss of the fixed embeddings: the temperature the
data "asks for" at that noise level, to set beside the τ the model learned.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from topoclip.analysis.inputs import encode_pairs
from topoclip.analysis.output import pyplot, save_figure, write_json
from topoclip.config import ConfigError
from topoclip.run.inference import Pretrained

FRACTIONS = (0.0, 0.15, 0.3, 0.5)
BATCH_SIZES = (32, 128, 512)
SCALES = tuple(10 ** (x / 10) for x in range(-10, 31))  # τ from 0.1 to 1000, 10 points a decade


def equilibrium_terms(similarity: torch.Tensor, scales) -> dict[str, torch.Tensor]:
    """similarity (b, b) with positives on the diagonal; scales: τ, a float or (T,) -> each term (T,) (0-d for a float).

    Returns {"alignment", "uniformity", "loss", "ratio"}; loss equals topoclip.core.losses.infonce_loss.
    """
    scales = torch.as_tensor(scales, dtype=torch.float32, device=similarity.device)
    logits = scales.reshape(-1, 1, 1) * similarity.float()  # (T, b, b)
    alignment = -logits.diagonal(dim1=1, dim2=2).mean(-1)  # (T,)
    uniformity = (torch.logsumexp(logits, dim=2).mean(-1) + torch.logsumexp(logits, dim=1).mean(-1)) / 2  # (T,)
    terms = {"alignment": alignment, "uniformity": uniformity, "loss": alignment + uniformity,
             "ratio": alignment / uniformity}
    if scales.dim() == 0:
        terms = {name: value[0] for name, value in terms.items()}
    return terms


def shuffled_pairing(batch: int, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """(batch,) caption index for each image: `fraction` of the rows get another chosen row's caption."""
    chosen_count = round(fraction * batch)
    if fraction > 0:
        chosen_count = max(chosen_count, 2)  # one row cannot swap with itself
    chosen_count = min(chosen_count, batch)
    pairing = torch.arange(batch)
    chosen = torch.randperm(batch, generator=generator)[:chosen_count]
    pairing[chosen] = chosen.roll(1)  # a cycle through the chosen rows: none keeps its own caption
    return pairing


def equilibrium_curves(score, images: torch.Tensor, texts: torch.Tensor, fractions: Sequence[float],
                       batch_sizes: Sequence[int], scales: Sequence[float], draws: int = 8, seed: int = 0) -> list[dict]:
    """For each (b, p): each term at every τ, averaged over `draws` random batches of the N pairs.

    score: (Bu, m, n), (Bv, m, n) -> (Bu, Bv); images, texts (N, m, n) with text i belonging to image i.
    """
    generator = torch.Generator().manual_seed(seed)
    scale_tensor = torch.tensor(list(scales), dtype=torch.float32)
    curves = []
    for batch in batch_sizes:
        for fraction in fractions:
            totals = None
            for _ in range(draws):
                members = torch.randperm(images.shape[0], generator=generator)[:batch]
                captions = members[shuffled_pairing(batch, fraction, generator)]
                similarity = score(images[members.to(images.device)], texts[captions.to(texts.device)]).cpu()
                terms = equilibrium_terms(similarity, scale_tensor)
                totals = terms if totals is None else {k: totals[k] + terms[k] for k in terms}
            mean = {k: v / draws for k, v in totals.items()}
            best = int(torch.argmin(mean["loss"]))
            curves.append({"batch_size": batch, "fraction": fraction, **{k: v.tolist() for k, v in mean.items()},
                           "best_scale": scales[best], "best_loss": mean["loss"][best].item()})
    return curves


def output_name(split: str) -> str:
    """equilibrium for the test split, equilibrium-SPLIT otherwise: an analysis of another split never replaces it."""
    return "equilibrium" if split == "test" else f"equilibrium-{split}"


def plot_curves(result: dict, out_dir):
    """equilibrium(-SPLIT).png: per batch size, the ratio A/U (top) and the loss (bottom) against τ, one line per p."""
    plt = pyplot()
    batch_sizes = sorted({c["batch_size"] for c in result["curves"]})
    figure, axes = plt.subplots(2, len(batch_sizes), figsize=(4.6 * len(batch_sizes), 7), squeeze=False, sharex=True)
    for column, batch in enumerate(batch_sizes):
        top, bottom = axes[0][column], axes[1][column]
        for curve in (c for c in result["curves"] if c["batch_size"] == batch):
            label = f"{curve['fraction']:.0%} shuffled"
            line, = top.plot(result["scales"], curve["ratio"], label=label)
            bottom.plot(result["scales"], curve["loss"], color=line.get_color())
            bottom.plot([curve["best_scale"]], [curve["best_loss"]], "o", color=line.get_color())
        for axis in (top, bottom):
            axis.set_xscale("log")
            axis.axvline(result["model_scale"], color="black", linestyle=":", linewidth=1)
            axis.grid(alpha=0.3)
        top.set_title(f"batch {batch} (dotted: the model's τ)", fontsize=9)
        bottom.set_xlabel("τ")
    axes[0][0].set_ylabel("alignment / uniformity  (−τ·s_ii / log Σ exp τ·s_ij)")
    axes[1][0].set_ylabel("InfoNCE loss (● = τ*)")
    axes[0][-1].legend(fontsize=8)
    figure.tight_layout()
    return save_figure(figure, out_dir, output_name(result["split"]))


def analyze_equilibrium(loaded: Pretrained, out_dir, size: int = 512, fractions: Sequence[float] = FRACTIONS,
                        batch_sizes: Sequence[int] = BATCH_SIZES, scales: Sequence[float] = SCALES, draws: int = 8,
                        seed: int = 0, split: str = "test") -> dict:
    """Encode `size` pairs of `split`, compute the curves, write equilibrium(-SPLIT).png and .json."""
    usable = sorted({b for b in batch_sizes if 2 <= b <= size})
    if not usable:
        raise ConfigError(f"batch sizes {list(batch_sizes)}: each needs 2 ≤ b ≤ --size {size}; pick smaller ones or a larger --size")
    with torch.inference_mode():
        encoded = encode_pairs(loaded, size, split=split)
        curves = equilibrium_curves(loaded.model.similarity, encoded.images, encoded.texts, fractions, usable,
                                    list(scales), draws, seed)
    model_scale = loaded.model.temperature.scale.item()
    result = {"analysis": "equilibrium", "model": loaded.name, "checkpoint": str(loaded.checkpoint),
              "topology": loaded.model.config.topology, "model_scale": model_scale, "model_t": math.log(model_scale),
              "split": split, "size": size, "draws": draws, "seed": seed, "scales": list(scales), "curves": curves}
    result["plots"] = [plot_curves(result, out_dir).name]
    write_json(out_dir, output_name(split), result)
    return result
