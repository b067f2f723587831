"""Distributions of similarities between samples (paper Fig. 6), in-domain and out-of-domain.

On N test pairs of the built-in scenes (caption i written for image i; see
:func:`topoclip.analysis.inputs.encode_pairs`), four kinds of similarity s = −d (before τ):

- positive image–text  s(u_i, v_i)
- negative image–text  s(u_i, v_j), i ≠ j
- negative image–image s(u_i, u_j), i ≠ j
- negative text–text   s(v_i, v_j), i ≠ j

scored with the model's topology ("summed": for ps-inner the sum of the m sub-sphere cosines, in
[−m, m]). For product spheres (ps-*), also per sub-sphere: the cosine u_kᵀv_k of each of the m
sub-spheres. "Out-of-domain" renders the same kind of scenes in the other rendering style (the
paper used RedCaps against YFCC). The scenes repeat attributes, so some "negatives" are true
matches (two red circles) — the false negatives of web data, in miniature.
"""
from __future__ import annotations

from typing import Callable

import torch

from topoclip.analysis.inputs import STYLES, EncodedPairs, encode_pairs
from topoclip.analysis.output import pyplot, save_figure, write_json
from topoclip.core.geometry import get_topology
from topoclip.run.inference import Pretrained

KINDS = ("positive image-text", "negative image-text", "negative image-image", "negative text-text")
BINS = 60
SPHERES_PLOTTED = 8  # per-sub-sphere panels drawn (the JSON has every sub-sphere)


def off_diagonal(matrix: torch.Tensor) -> torch.Tensor:
    """(N, N) -> (N·(N − 1),) the entries with row ≠ column."""
    keep = ~torch.eye(matrix.shape[0], dtype=torch.bool, device=matrix.device)
    return matrix[keep]


def similarity_samples(score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], images: torch.Tensor,
                       texts: torch.Tensor) -> dict[str, torch.Tensor]:
    """The four kinds of similarity of N pairs: {kind: 1-d tensor}; score: (Bu, m, n), (Bv, m, n) -> (Bu, Bv)."""
    image_text = score(images, texts)  # (N, N)
    return {
        "positive image-text": image_text.diagonal(),
        "negative image-text": off_diagonal(image_text),
        "negative image-image": off_diagonal(score(images, images)),
        "negative text-text": off_diagonal(score(texts, texts)),
    }


def sphere_score(k: int, model=None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The score on factor k: (Bu, m, n), (Bv, m, n) -> (Bu, Bv): the cosine u_k · v_kᵀ on a sub-sphere, the negative
    distance −d(u_k, v_k) on a hyperboloid of a hyperbolic `model` (whose similarity is the sum of these)."""
    if model is not None and model.curvature is not None:
        return lambda u, v: model.similarity(u[:, k : k + 1], v[:, k : k + 1])
    return lambda u, v: u[:, k].float() @ v[:, k].float().T


def summarize(values: torch.Tensor) -> dict[str, float]:
    """count, mean, std, min, 5/25/50/75/95 % quantiles, max of a 1-d tensor."""
    values = values.detach().float().cpu()
    if values.numel() > 2**24:  # torch.quantile's input limit; a strided subsample keeps the shape
        sample = values[:: values.numel() // 2**24 + 1]
    else:
        sample = values
    quantiles = torch.quantile(sample, torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95]))
    return {"count": values.numel(), "mean": values.mean().item(), "std": values.std().item() if values.numel() > 1 else 0.0,
            "min": values.min().item(), "p05": quantiles[0].item(), "p25": quantiles[1].item(),
            "median": quantiles[2].item(), "p75": quantiles[3].item(), "p95": quantiles[4].item(),
            "max": values.max().item()}


def distributions(samples: dict[str, torch.Tensor], bins: int = BINS) -> dict:
    """{kind: {summary…, "histogram": {"edges", "counts"}}} on shared edges, plus the overlap of
    positives and negatives: the share of negative image–text scores above the median positive."""
    everything = torch.cat([v.float().cpu() for v in samples.values()])
    low, high = everything.min().item(), everything.max().item()
    if high <= low:
        high = low + 1e-6
    edges = torch.linspace(low, high, bins + 1)
    out = {}
    for kind, values in samples.items():
        values = values.float().cpu()
        counts = torch.histc(values, bins=bins, min=low, max=high)
        out[kind] = {**summarize(values), "histogram": {"edges": edges, "counts": counts.long()}}
    median_positive = out["positive image-text"]["median"]
    out["negatives_above_median_positive"] = (samples["negative image-text"].float() > median_positive).float().mean().item()
    return out


def domain_distributions(loaded: Pretrained, encoded: EncodedPairs) -> dict:
    """Summed and (for product spheres) per-sub-sphere distributions of one domain."""
    model = loaded.model
    result = {"summed": distributions(similarity_samples(model.similarity, encoded.images, encoded.texts))}
    if get_topology(model.config.topology).product:
        result["per_sphere"] = [distributions(similarity_samples(sphere_score(k, model), encoded.images, encoded.texts))
                                for k in range(encoded.images.shape[1])]
    return result


def _histograms(axis, record: dict, title: str) -> None:
    for kind in KINDS:
        edges = record[kind]["histogram"]["edges"]
        counts = record[kind]["histogram"]["counts"].float()
        density = counts / counts.sum().clamp_min(1) / (edges[1] - edges[0])
        axis.stairs(density.numpy(), edges.numpy(), label=kind, linewidth=1.3)
    axis.set_title(title, fontsize=9)
    axis.set_xlabel("similarity s = −d")
    axis.grid(alpha=0.3)


def plot_distributions(result: dict, out_dir) -> list:
    """similarities.png (summed, one panel per domain) and, for product spheres, similarities_per_sphere.png."""
    plt = pyplot()
    domains = list(result["domains"])
    figure, axes = plt.subplots(1, len(domains), figsize=(5.5 * len(domains), 3.8), squeeze=False)
    for axis, domain in zip(axes[0], domains):
        _histograms(axis, result["domains"][domain]["summed"], f"{domain}: {result['topology']} (summed)")
    axes[0][0].set_ylabel("density")
    axes[0][-1].legend(fontsize=8)
    figure.tight_layout()
    paths = [save_figure(figure, out_dir, "similarities")]
    if "per_sphere" in result["domains"][domains[0]]:
        shown = min(result["spheres"], SPHERES_PLOTTED)
        figure, axes = plt.subplots(len(domains), shown, figsize=(2.6 * shown, 2.4 * len(domains)), squeeze=False)
        hyperbolic = result["topology"].startswith("lorentz")
        for row, domain in enumerate(domains):
            for k in range(shown):
                _histograms(axes[row][k], result["domains"][domain]["per_sphere"][k],
                            f"{domain}, {'hyperboloid' if hyperbolic else 'sphere'} {k}")
                axes[row][k].set_xlabel("−distance" if hyperbolic else "cosine")
        axes[0][-1].legend(fontsize=6)
        figure.tight_layout()
        paths.append(save_figure(figure, out_dir, "similarities_per_sphere"))
    return paths


def analyze_similarities(loaded: Pretrained, out_dir, size: int = 500, batch_size: int = 256) -> dict:
    """Encode `size` pairs per domain, write similarities*.png and similarities.json; returns the JSON dict."""
    model = loaded.model
    m, n = model.embedding_shape
    result = {"analysis": "similarities", "model": loaded.name, "checkpoint": str(loaded.checkpoint),
              "topology": model.config.topology, "spheres": m, "sphere_dim": n,
              "scale": model.temperature.scale.item(), "size": size, "domains": {}}
    with torch.inference_mode():
        for style in STYLES:
            encoded = encode_pairs(loaded, size, style, batch_size)
            result["domains"][style] = domain_distributions(loaded, encoded)
    result["plots"] = [p.name for p in plot_distributions(result, out_dir)]
    write_json(out_dir, "similarities", result)
    return result
