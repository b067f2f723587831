"""GPU throughput of the paper's large-scale pair: the ViT-B/16 sphere baseline vs Multi(32, 16).

    python benchmarks/gpu_throughput.py --batch 256 --precision bf16

Prints one JSON line per preset (images/s for forward + backward + AdamW on one GPU) and a last
line with the cost of the extra class tokens: 1 − images/s(Multi) / images/s(sphere)
(the paper: < 8 %; the transformer FLOP formula's estimate for 15 extra tokens on ViT-B/16: ≈ 7–8 %).
"""
from __future__ import annotations

import argparse
import json

import torch

from train_step import measure


def flops_overhead(grid_tokens: int = 196, extra: int = 15, width: int = 768) -> float:
    """The transformer FLOP formula: forward FLOPs ∝ tokens · (12·width² + 2·tokens·width); the extra tokens' share."""
    def cost(tokens: int) -> float:
        return tokens * (12 * width**2 + 2 * tokens * width)
    return cost(grid_tokens + 1 + extra) / cost(grid_tokens + 1) - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="sphere-vit-b16,multi-32x16-vit-b16")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--text-length", type=int, default=0, help="real tokens per text (0 = the full 77)")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark is for a GPU (use benchmarks/train_step.py on CPU)")
    results = []
    for preset in args.presets.split(","):
        result = measure(preset, args.batch, device=args.device, precision=args.precision, steps=args.steps,
                         warmup=args.warmup, text_length=args.text_length, compile=args.compile)
        results.append(result)
        print(json.dumps(result), flush=True)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if len(results) >= 2:
        base, other = results[0], results[1]
        print(json.dumps({
            "benchmark": "class_token_overhead", "base": base["preset"], "other": other["preset"],
            "overhead": round(1 - other["median_images_per_s"] / base["median_images_per_s"], 4),
            "flops_estimate": round(flops_overhead(), 4),
        }))


if __name__ == "__main__":
    main()
