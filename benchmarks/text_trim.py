"""What the text tower's padding trim is worth: forward + backward time of the text tower at three trims.

    python benchmarks/text_trim.py --preset openclip-ref --batch 128 --threads 2
    python benchmarks/text_trim.py --preset sphere-vit-b16 --batch 256 --device cuda --precision bf16

Captions get random lengths in [--shortest, --longest] tokens (CLIP-style alt-texts: most are short).
Times, alternating round by round: `exact` (the batch's longest caption: eager topoclip on a CPU),
`bucket8` (rounded up to a multiple of 8: eager topoclip on a GPU), `full` (the whole context,
masked: what torch.compile runs).
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from topoclip.config import load_config
from topoclip.model.clip import CLIP
from topoclip.model.text import LENGTH_BUCKET, trimmed_length
from topoclip.run.training.step import autocast_context
from train_step import time_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="openclip-ref")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--shortest", type=int, default=6)
    parser.add_argument("--longest", type=int, default=21)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = load_config(args.preset).model
    tower = CLIP(config).text.to(args.device).train()
    context = config.text.context_length
    lengths = torch.randint(args.shortest, min(args.longest, context) + 1, (args.batch,), device=args.device)
    mask = torch.arange(context, device=args.device)[None, :] < lengths[:, None]
    ids = torch.randint(5, config.text.vocab_size, (args.batch, context), device=args.device).masked_fill(~mask, 0)
    ids[:, 0] = config.text.cls_token_id
    columns = {"exact": trimmed_length(mask, bucket=1), "bucket8": trimmed_length(mask, bucket=LENGTH_BUCKET), "full": context}

    def step_for(used: int):
        def step() -> None:
            with autocast_context(args.precision, ids.device.type):
                out = tower.encode_tokens(ids[:, :used], mask[:, :used], padded=True)
            out.float().square().mean().backward()
            tower.zero_grad(set_to_none=True)
        return step

    rates = {name: [] for name in columns}
    for _ in range(args.rounds):
        for name, used in columns.items():
            rates[name].append(args.batch / statistics.median(time_steps(step_for(used), args.device, args.steps,
                                                                         args.warmup)))
    exact = statistics.median(rates["exact"])
    for name, used in columns.items():
        rate = statistics.median(rates[name])
        print(json.dumps({"benchmark": "text_trim", "trim": name, "columns": used, "preset": args.preset,
                          "batch": args.batch, "device": args.device, "precision": args.precision,
                          "threads": torch.get_num_threads(), "median_texts_per_s": round(rate, 1),
                          "range": [round(min(rates[name]), 1), round(max(rates[name]), 1)],
                          "relative_to_exact": round(rate / exact, 3)}))


if __name__ == "__main__":
    main()
