"""End-to-end training speed on WebDataset shards of JPEGs vs the same step on random tensors.

    python benchmarks/shard_throughput.py --preset sphere-vit-b16 --batch 256 --precision bf16 [--compile]
    python benchmarks/shard_throughput.py --preset tiny --batch 64 --samples 2048 --device cpu   # CPU smoke figure

Writes its own shards first (--samples smooth random pictures of --image-size px, JPEG quality 90,
with 8–20-word captions; reused when the folder already holds them), then times the trainer's data
path — `training_batches` with train.num_workers workers (default: the config's), the workers
decoding, cropping, normalising and tokenising, pinned memory, copies to the GPU one step ahead
on a side stream (`prefetch_to_device`) — feeding the trainer's step (forward_backward_loss + optimizer_step, nothing read on the host
between steps), against the same step on one batch of random tensors already on the device.
Prints one JSON line per run and a last line with shards / random.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from train_step import synchronize, topoclip_step

WORDS = ("a red cube on the left of a small blue ball under green light near two yellow stars and a "
         "large purple ring beside an orange square above three white circles at night").split()


def make_shards(folder: Path, samples: int, image_size: int, per_shard: int = 256) -> str:
    """Write (or reuse) `samples` JPEG image–caption pairs as shards in `folder`; returns their brace pattern."""
    from topoclip.data.shards import shard_pattern, write_shards

    existing = sorted(folder.glob("*.tar"))
    if len(existing) == -(-samples // per_shard):
        return shard_pattern(existing)
    rng = np.random.default_rng(0)

    def pictures():
        from PIL import Image

        for _ in range(samples):
            small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)  # smooth, photo-like content once upsampled
            image = Image.fromarray(small).resize((image_size, image_size), Image.BICUBIC)
            caption = " ".join(rng.choice(WORDS, size=int(rng.integers(8, 21))))
            yield np.asarray(image), caption

    return shard_pattern(write_shards(pictures(), folder, samples_per_shard=per_shard, quality=90))


def run(args, source: str, pattern: str) -> dict:
    from topoclip.config import load_config
    from topoclip.tokenizer import Tokenizer
    from topoclip.training.data import prefetch_to_device, training_batches

    overrides = [f"train.batch_size={args.batch}"] + args.overrides
    step, model, (images, text) = topoclip_step(args.preset, args.batch, device=args.device, precision=args.precision,
                                                overrides=tuple(overrides), compile=args.compile)
    config = load_config(args.preset, overrides + ["data.source=shards", f"data.train_data={pattern}",
                                                   "data.resampled=true", f"data.samples_per_epoch={args.samples}"]
                         + ([f"train.num_workers={args.workers}"] if args.workers >= 0 else []))
    cuda = args.device.startswith("cuda")
    if source == "shards":
        tokenizer = Tokenizer.train([" ".join(WORDS)] * 10, vocab_size=min(config.model.text.vocab_size, 1000),
                                    context_length=config.model.text.context_length)
        batches = prefetch_to_device(training_batches(config, 0, tokenizer=tokenizer, pin_memory=cuda),
                                     torch.device(args.device))
        # The trainer's step, on the loader's batches: the images and tokens are swapped in place.
        def feed() -> None:
            batch = next(batches)
            images.copy_(batch.images.to(args.device, non_blocking=True))
            fresh = batch.text.to(args.device, non_blocking=True)
            text.input_ids.copy_(fresh.input_ids)
            text.attention_mask.copy_(fresh.attention_mask)
    else:
        def feed() -> None:
            pass
    for _ in range(args.warmup):
        feed()
        step()
    synchronize(args.device)
    start = time.perf_counter()
    for _ in range(args.steps):
        feed()
        step()
    synchronize(args.device)
    seconds = time.perf_counter() - start
    return {"benchmark": "shard_throughput", "source": source, "preset": args.preset, "batch": args.batch,
            "device": args.device, "precision": args.precision, "compile": args.compile,
            "num_workers": config.train.num_workers, "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
            "steps": args.steps, "images_per_s": round(args.batch * args.steps / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="sphere-vit-b16")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="", choices=["", "fp32", "bf16", "fp16"],
                        help="default: bf16 on a GPU, fp32 on a CPU")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads for the model (0 = torch's default)")
    parser.add_argument("--workers", type=int, default=-1, help="loader workers (-1 = the config's train.num_workers)")
    parser.add_argument("--samples", type=int, default=8192, help="samples in the shards (an epoch)")
    parser.add_argument("--image-size", type=int, default=256, help="stored JPEG size in pixels")
    parser.add_argument("--shards", default="", help="folder for the shards (default: a temporary folder)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    args.precision = args.precision or ("bf16" if args.device.startswith("cuda") else "fp32")
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(args.shards or temporary)
        started = time.perf_counter()
        pattern = make_shards(folder, args.samples, args.image_size)
        print(json.dumps({"shards": pattern, "samples": args.samples, "image_size": args.image_size,
                          "seconds_to_write": round(time.perf_counter() - started, 1)}), flush=True)
        results = {}
        for source in ("random", "shards"):
            results[source] = run(args, source, pattern)
            print(json.dumps(results[source]), flush=True)
        print(json.dumps({"benchmark": "shard_to_random", "ratio": round(
            results["shards"]["images_per_s"] / results["random"]["images_per_s"], 3)}))


if __name__ == "__main__":
    main()
