"""End-to-end training speed on WebDataset shards of JPEGs vs the same step on random tensors.

    python benchmarks/shard_throughput.py --preset sphere-vit-b16 --batch 256 --precision bf16 [--compile]
    python benchmarks/shard_throughput.py --preset tiny --batch 64 --samples 2048 --device cpu   # CPU smoke figure

Writes its own shards first (--samples smooth random pictures of --image-size px, JPEG quality 90,
with 8–20-word captions; reused when the folder already holds them). Then one training step
(forward_backward_loss + optimizer_step, nothing read on the host between steps) is timed in
alternating windows fed two ways: `shards`, the trainer's data path — `training_batches` with
train.num_workers workers (default: the config's) decoding, cropping, normalising and tokenising,
pinned memory, copies to the GPU one step ahead on a side stream (`prefetch_to_device`), in epochs of
--samples-per-epoch (by default longer than the run: the steady state; with 0, --samples, an epoch's start falls in
about every window, and what it costs shows) — and
`random`, the same step on inputs already on the device. One JSON line per window, then the medians
and the shards / random ratio (median of the rounds' ratios, and its range).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from topoclip.run.training.data import prefetch_factor
from train_step import synchronize, topoclip_step

WORDS = ("a red cube on the left of a small blue ball under green light near two yellow stars and a "
         "large purple ring beside an orange square above three white circles at night").split()


def make_shards(folder: Path, samples: int, image_size: int, per_shard: int = 256) -> str:
    """Write (or reuse) `samples` JPEG image–caption pairs as shards in `folder`; returns their brace pattern."""
    from topoclip.data.shard_writer import shard_pattern, write_shards

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


def feeds(args, pattern: str):
    """(step(), {"random": feed, "shards": feed}, config, waited): one training step, the two ways to fill its inputs,
    and waited[0], the seconds the shards' feed has spent waiting for the loader's next batch."""
    from topoclip.config import load_config
    from topoclip.preprocess.tokenizer import Tokenizer
    from topoclip.run.training.data import prefetch_to_device, training_batches

    overrides = [f"train.batch_size={args.batch}"] + args.overrides
    step, _, (images, text) = topoclip_step(args.preset, args.batch, device=args.device, precision=args.precision,
                                            overrides=tuple(overrides), compile=args.compile)
    config = load_config(args.preset, overrides + ["data.source=shards", f"data.train_data={pattern}", "data.resampled=true",
                                                   f"data.samples_per_epoch={args.samples_per_epoch or args.samples}"]
                         + ([f"train.num_workers={args.workers}"] if args.workers >= 0 else []))
    tokenizer = Tokenizer.train([" ".join(WORDS)] * 10, vocab_size=min(config.model.text.vocab_size, 1000),
                                context_length=config.model.text.context_length)
    batches = prefetch_to_device(training_batches(config, 0, tokenizer=tokenizer,
                                                  pin_memory=args.device.startswith("cuda")), torch.device(args.device))

    waited = [0.0]

    def from_shards() -> None:
        # The trainer's inputs: the batch arrives on the device (copied a step ahead); the step's input
        # tensors take its values (a device-to-device copy, ~0.1 ms for 150 MB on a GPU). The host runs ahead
        # of the GPU, so time spent here is time the loader, not the step, held the loop.
        began = time.perf_counter()
        batch = next(batches)
        waited[0] += time.perf_counter() - began
        images.copy_(batch.images)
        text.input_ids.copy_(batch.text.input_ids)
        text.attention_mask.copy_(batch.text.attention_mask)

    return step, {"random": lambda: None, "shards": from_shards}, config, waited


def timed(step, feed, device: str, warmup: int, steps: int, waited: Optional[list] = None) -> float:
    """Seconds of `steps` steps after `warmup` untimed ones (synchronised on a GPU); waited[0] is reset with the
    clock."""
    for _ in range(warmup):
        feed()
        step()
    synchronize(device)
    if waited is not None:
        waited[0] = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        feed()
        step()
    synchronize(device)
    return time.perf_counter() - start


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
    parser.add_argument("--samples", type=int, default=8192, help="samples in the shards")
    parser.add_argument("--samples-per-epoch", type=int, default=10**8,
                        help="the resampled stream's epoch (data.samples_per_epoch); the default is longer than any "
                             "window: the steady state. 0 = --samples, an epoch's start in every window or so")
    parser.add_argument("--image-size", type=int, default=256, help="stored JPEG size in pixels")
    parser.add_argument("--shards", default="", help="folder for the shards (default: a temporary folder)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per window")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per source first")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (a window of each source per round)")
    parser.add_argument("--in-flight", type=int, default=0, help="batches the workers may queue together "
                        "(0 = LOADER_BATCHES_IN_FLIGHT, the trainer's)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if args.in_flight:
        from topoclip.run.training import data

        data.LOADER_BATCHES_IN_FLIGHT = args.in_flight
    args.precision = args.precision or ("bf16" if args.device.startswith("cuda") else "fp32")
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(args.shards or temporary)
        started = time.perf_counter()
        pattern = make_shards(folder, args.samples, args.image_size)
        print(json.dumps({"shards": pattern, "samples": args.samples, "image_size": args.image_size,
                          "seconds_to_write": round(time.perf_counter() - started, 1)}), flush=True)
        step, sources, config, waited = feeds(args, pattern)
        for feed in sources.values():
            timed(step, feed, args.device, args.warmup, 0)  # compilation, worker start-up, caches
        workers = config.train.num_workers
        # Alternating windows, so machine noise hits both; each window first drains what the loader
        # buffered while the other ran (workers × prefetch factor + 2 batches), untimed.
        drain = max(workers, 1) * (prefetch_factor(workers) if workers else 1) + 2
        rates, waits = {name: [] for name in sources}, []
        for round_index in range(args.rounds):
            for name, feed in sources.items():
                seconds = timed(step, feed, args.device, drain, args.steps, waited)
                rates[name].append(args.batch * args.steps / seconds)
                line = {"round": round_index, "source": name, "images_per_s": round(rates[name][-1], 1)}
                if name == "shards":
                    waits.append(1000 * waited[0] / args.steps)
                    line["loader_wait_ms_per_step"] = round(waits[-1], 2)
                print(json.dumps(line), flush=True)
        ratios = [shards / random for shards, random in zip(rates["shards"], rates["random"])]
        print(json.dumps({
            "benchmark": "shard_throughput", "preset": args.preset, "batch": args.batch, "device": args.device,
            "precision": args.precision, "compile": args.compile, "num_workers": config.train.num_workers,
            "samples_per_epoch": config.data.samples_per_epoch,
            "batches_in_flight": workers * prefetch_factor(workers) if workers else 0,
            "loader_wait_ms_per_step": round(statistics.median(waits), 2),
            "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(), "rounds": args.rounds,
            "steps": args.steps, "random_images_per_s": round(statistics.median(rates["random"]), 1),
            "shards_images_per_s": round(statistics.median(rates["shards"]), 1),
            "shard_to_random": round(statistics.median(ratios), 3),
            "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)]}))


if __name__ == "__main__":
    main()
