"""Training-step throughput on CPU: forward + backward + AdamW of a preset, one JSON line.

    python benchmarks/train_step.py --preset openclip-ref --batch 128 --threads 2

Inputs are random: images at the preset's size, texts of `--text-length` real tokens (default:
the full context, no padding — the same work a causal CLIP does on every position).
"""
from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import torch

import topoclip
from topoclip.config import load_config
from topoclip.losses import get_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="openclip-ref")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--text-length", type=int, default=0, help="real tokens per text (0 = full context)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = load_config(args.preset, args.overrides)
    model = topoclip.CLIP(config.model).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    loss_fn = get_loss(config.train.loss)
    vision, text = config.model.vision, config.model.text
    images = torch.randn(args.batch, 3, vision.image_size, vision.image_size)
    length = args.text_length or text.context_length
    ids = torch.randint(5, text.vocab_size, (args.batch, text.context_length))
    ids[:, 0] = text.cls_token_id
    mask = (torch.arange(text.context_length)[None, :] < length).expand(args.batch, -1)
    batch = SimpleNamespace(input_ids=ids.masked_fill(~mask, 0), attention_mask=mask)

    def step() -> float:
        out = model(images, batch)
        similarity = model.similarity(out.image_embeds, out.text_embeds)
        loss = loss_fn(similarity, similarity.T, out.scale, out.bias)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        model.temperature.clamp_()
        return loss.item()

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    seconds = sum(times)
    median = sorted(times)[len(times) // 2]  # robust to a noisy neighbour on a shared machine
    print(json.dumps({
        "benchmark": "train_step", "preset": args.preset, "overrides": args.overrides, "batch": args.batch,
        "threads": args.threads, "text_length": length, "steps": args.steps,
        "seconds_per_step": round(seconds / args.steps, 4), "images_per_s": round(args.batch * args.steps / seconds, 1),
        "median_images_per_s": round(args.batch / median, 1),
        "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
