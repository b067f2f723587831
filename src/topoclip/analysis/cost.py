"""What a configuration costs: parameters, forward FLOPs per sample, logit-matrix memory.

- Parameters: total and per tower (the temperature's t and β counted apart).
- Forward FLOPs per sample (one image, one text of the full context length), two ways:
  *counted* with ``torch.utils.flop_counter`` on a real forward pass (matmuls, the patch
  convolution and attention; a multiply–add is 2 FLOPs) — exact for this implementation, whose last
  block computes only the class-token rows — and the transformer FLOP *formula* per tower,
  tokens · layers · (12·width² + 2·tokens·width) multiply–adds × 2, with tokens = grid² + m (image)
  and context + m − 1 (text), which counts every block in full and leaves out the patch embedding
  and the projections.
- Logit memory per batch size B (fp32, one process): the (B, B) similarity matrix, and the largest
  intermediate the pairwise score needs — none beyond it for sphere / ps-inner / euclidean (one
  matmul), a (rows, B, m) block for ps-geodesic, whose row chunks keep it within
  ``geometry.CHUNK_ELEMENTS`` (a naive (B, B, m) tensor is reported beside it).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from topoclip.core import geometry
from topoclip.analysis.output import pyplot, save_figure, write_json
from topoclip.config import Config, ModelConfig

BATCH_SIZES = (128, 1024, 2048, 4096, 16384, 32768)
BYTES_PER_FLOAT = 4


def count_parameters(model) -> dict[str, int]:
    """{"total", "vision", "text", "temperature"} parameter counts, and "curvature" (c and the towers' scalings) for a
    hyperbolic model: the parts sum to the total."""
    def count(module) -> int:
        return sum(p.numel() for p in module.parameters())

    counts = {"total": count(model), "vision": count(model.visual), "text": count(model.text),
              "temperature": count(model.temperature)}
    return counts | ({"curvature": count(model.curvature)} if model.curvature is not None else {})


def _attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    # CPU attention runs a kernel the counter has no formula for; count it as the fused kernels are.
    extra = {}
    cpu_attention = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if cpu_attention is not None:
        extra[cpu_attention] = _attention_flops
    return FlopCounterMode(display=False, custom_mapping=extra)


def counted_flops(model) -> dict[str, int]:
    """Forward FLOPs of one image and one full-length text through `model` (a CLIP on the CPU)."""
    vision, text = model.config.vision, model.config.text
    image = torch.zeros(1, 3, vision.image_size, vision.image_size)
    ids = torch.full((1, text.context_length), text.cls_token_id, dtype=torch.int64)
    mask = torch.ones(1, text.context_length, dtype=torch.bool)
    counts = {}
    with torch.no_grad():
        counter = _flop_counter()
        with counter:
            model.visual(image)
        counts["image"] = counter.get_total_flops()
        counter = _flop_counter()
        with counter:
            model.text(ids, mask)
        counts["text"] = counter.get_total_flops()
    counts["total"] = counts["image"] + counts["text"]
    return counts


def tower_formula_flops(tokens: int, layers: int, width: int) -> int:
    """The transformer FLOP formula: tokens · layers · (12·width² + 2·tokens·width) multiply–adds, × 2 FLOPs."""
    return 2 * tokens * layers * (12 * width * width + 2 * tokens * width)


def formula_flops(config: ModelConfig) -> dict[str, int]:
    """The FLOP formula's estimate per tower and in total."""
    vision, text, m = config.vision, config.text, config.class_tokens
    image_tokens = (vision.image_size // vision.patch_size) ** 2 + (m if vision.pooling == "class_tokens" else 0)
    text_tokens = text.context_length + m - 1
    counts = {"image": tower_formula_flops(image_tokens, vision.layers, vision.width),
              "text": tower_formula_flops(text_tokens, text.layers, text.width),
              "image_tokens": image_tokens, "text_tokens": text_tokens}
    counts["total"] = counts["image"] + counts["text"]
    return counts


def logit_memory(config: ModelConfig, batch_sizes: Sequence[int] = BATCH_SIZES) -> list[dict]:
    """Bytes of the (B, B) fp32 similarity and of the pairwise score's largest intermediate, per B."""
    m = config.sphere_count
    chunked = geometry.get_topology(config.topology).chunked
    rows = []
    for batch in batch_sizes:
        logits = BYTES_PER_FLOAT * batch * batch
        naive = BYTES_PER_FLOAT * batch * batch * m if chunked else 0
        per_chunk = BYTES_PER_FLOAT * min(batch, geometry.chunk_rows(config.topology, batch, m)) * batch * m
        rows.append({"batch_size": batch, "logit_bytes": logits, "intermediate_bytes": per_chunk if chunked else 0,
                     "naive_intermediate_bytes": naive})
    return rows


def preset_cost(config: Config, batch_sizes: Sequence[int] = BATCH_SIZES, name: Optional[str] = None) -> dict:
    """Every cost figure of one configuration (builds the model on the CPU with random weights)."""
    from topoclip.model.clip import CLIP

    model = CLIP(config.model).eval()
    counted, formula = counted_flops(model), formula_flops(config.model)
    m, n = config.model.sphere_count, config.model.sphere_dim
    return {"name": name or config.name, "topology": config.model.topology, "class_tokens": config.model.class_tokens,
            "spheres": m, "sphere_dim": n, "parameters": count_parameters(model), "flops_counted": counted,
            "flops_formula": formula, "counted_over_formula": counted["total"] / formula["total"],
            "logit_memory": logit_memory(config.model, batch_sizes)}


def plot_costs(result: dict, out_dir):
    """cost.png: forward GFLOPs per sample (counted vs formula) and logit memory against the batch size."""
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = [entry["name"] for entry in result["configs"]]
    positions = torch.arange(len(names)).float()
    left.bar(positions - 0.2, [e["flops_counted"]["total"] / 1e9 for e in result["configs"]], 0.4, label="counted")
    left.bar(positions + 0.2, [e["flops_formula"]["total"] / 1e9 for e in result["configs"]], 0.4, label="FLOP formula")
    left.set_xticks(positions.tolist(), names, rotation=20, ha="right", fontsize=8)
    left.set_ylabel("forward GFLOPs per image + text")
    left.set_yscale("log")
    left.legend(fontsize=8)
    left.grid(alpha=0.3, axis="y")
    for entry in result["configs"]:
        batches = [r["batch_size"] for r in entry["logit_memory"]]
        total = [(r["logit_bytes"] + r["intermediate_bytes"]) / 2**20 for r in entry["logit_memory"]]
        right.plot(batches, total, marker="o", label=entry["name"])
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("batch size B")
    right.set_ylabel("fp32 logits + pairwise intermediate (MiB)")
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    figure.tight_layout()
    return save_figure(figure, out_dir, "cost")


def analyze_cost(configs: Sequence[Config], out_dir, batch_sizes: Sequence[int] = BATCH_SIZES,
                 names: Optional[Sequence[str]] = None) -> dict:
    """Cost of each configuration; writes cost.png and cost.json."""
    names = list(names) if names is not None else [c.name for c in configs]
    result = {"analysis": "cost", "configs": [preset_cost(c, batch_sizes, n) for c, n in zip(configs, names)]}
    result["plots"] = [plot_costs(result, out_dir).name]
    write_json(out_dir, "cost", result)
    return result
