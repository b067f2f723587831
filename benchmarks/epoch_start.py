"""What an epoch's start costs the trainer on user shards, and what it is spent on.

    python benchmarks/epoch_start.py                                   # 1 worker, batch 64, on this machine's cores
    python benchmarks/epoch_start.py --workers 8 --batch 256 --epoch-batches 32 --out epoch-start.json   # a GPU node's

The trainer keeps its loader's workers across epochs (topoclip.data.streams: SharedEpoch), yet on a GPU node an epoch
of 32 batches still fed the compiled ViT-B/16 step 0.72 of what random tensors do, against 0.99 with no epoch start in
the window (docs/benchmarks.md): about 1.1 s an epoch. Two measurements, on benchmarks/loader.py's photo-like shards:

1. `boundary`: the trainer's batches (`training_batches`, --workers workers, pinned where CUDA is), taken as fast as
   they come, over --epochs epochs of --epoch-batches batches: the gap before each epoch's first batch (the first
   epoch's aside) against the mean gap inside an epoch (the workers' rate: a batch already queued comes at once, the
   next one a worker's batch later). With no step to wait for, the workers' queue is empty at a boundary, as on a GPU
   node whose loader only just keeps up.
2. `one_worker`: the dataset alone in this process as one worker runs it (one thread, captions tokenized), for each
   --shuffle-buffer size: from `set_epoch` to the epoch's first batch, against a batch later in the epoch. The
   difference is what a worker does before its first batch of every epoch: opening its first shard and filling the
   shuffle buffer (data.shuffle_buffer samples read from the tars, undecoded, before the first is drawn).

The prediction these test: at a boundary the trainer waits for a worker's epoch start plus the whole of one batch,
which in steady state the workers make side by side, so `boundary`'s gap is about `one_worker`'s first batch however
many workers there are. One JSON line per measurement, then the summary (--out: also written there).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loader import WORDS, make_shards  # noqa: E402  (benchmarks/loader.py: its photo-like shards)


def config_for(pattern: str, args, shuffle_buffer: int):
    from topoclip.config import load_config

    return load_config(args.preset, ["data.source=shards", f"data.train_data={pattern}", "data.resampled=true",
                                     f"data.samples_per_epoch={args.batch * args.epoch_batches}",
                                     f"data.shuffle_buffer={shuffle_buffer}", f"train.batch_size={args.batch}",
                                     f"train.num_workers={args.workers}"])


def epoch_gaps(arrivals: list[float], epoch_batches: int) -> tuple[list[float], list[float]]:
    """(the gap before each epoch's first batch but the first epoch's, the gaps inside the epochs after the first) of
    batches arriving at `arrivals`, `epoch_batches` an epoch."""
    gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:])]  # gaps[i]: before batch i + 1
    starts = [gaps[k * epoch_batches - 1] for k in range(1, len(arrivals) // epoch_batches)]
    inside = [gap for index, gap in enumerate(gaps) if index >= epoch_batches and (index + 1) % epoch_batches]
    return starts, inside


def boundary(pattern: str, args, tokenizer) -> dict:
    """Gaps between the trainer's batches: before each epoch's first (the first epoch's start-up aside) and inside."""
    import torch

    from topoclip.run.training.data import training_batches

    config = config_for(pattern, args, args.default_buffer)
    stream = training_batches(config, 0, tokenizer=tokenizer, pin_memory=torch.cuda.is_available())
    arrivals = []
    for _ in range(args.epoch_batches * args.epochs):
        next(stream)
        arrivals.append(time.perf_counter())
    starts, inside = epoch_gaps(arrivals, args.epoch_batches)
    return {"measurement": "boundary", "workers": args.workers, "shuffle_buffer": args.default_buffer,
            "epoch_start_gap_ms": [round(1000 * gap, 1) for gap in starts],
            "mean_gap_ms": round(1000 * statistics.mean(inside), 1)}


def one_worker(pattern: str, args, shuffle_buffer: int, tokenizer) -> dict:
    """From set_epoch to the first batch, and a batch in the epoch's middle, in this process as worker 0 of 1 (one
    thread, as DataLoader's workers run; captions tokenized, as the trainer's workers do)."""
    import torch

    from topoclip.data.sources import open_shards
    from topoclip.preprocess.transforms import TrainingCrop

    config = config_for(pattern, args, shuffle_buffer)
    generator = torch.Generator()
    transform = TrainingCrop(config.model.vision.image_size, scale=config.data.augment_scale, generator=generator)
    dataset = open_shards(config.data, transform=transform, batch_size=args.batch, seed=0, rank=0, world_size=1,
                          crop_generator=generator)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    first, later = [], []
    try:
        for epoch in range(args.epochs):
            dataset.set_epoch(epoch)
            began = time.perf_counter()
            batches = iter(dataset)
            tokenizer(next(batches).captions)
            first.append(time.perf_counter() - began)
            next(batches)  # the second batch: the buffer is full from here on
            began = time.perf_counter()
            tokenizer(next(batches).captions)
            later.append(time.perf_counter() - began)
    finally:
        torch.set_num_threads(threads)
    return {"measurement": "one_worker", "shuffle_buffer": shuffle_buffer,
            "first_batch_ms": round(1000 * statistics.median(first), 1),
            "later_batch_ms": round(1000 * statistics.median(later), 1),
            "epoch_start_ms": round(1000 * (statistics.median(first) - statistics.median(later)), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="sphere-vit-b16", help="whose image size and text length (no model runs)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epoch-batches", type=int, default=12, help="batches an epoch (at least 3, a multiple of "
                        "--workers)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--shuffle-buffer", type=int, nargs="+", default=[1, 1000, 5000],
                        help="data.shuffle_buffer sizes for `one_worker` (1: no shuffle buffer)")
    parser.add_argument("--samples", type=int, default=2048, help="samples in the shards")
    parser.add_argument("--shards", default="epoch-start-shards", help="folder for the shards (reused when whole)")
    parser.add_argument("--out", help="also write the summary here")
    args = parser.parse_args()
    if args.epoch_batches < 3 or args.epoch_batches % max(args.workers, 1) or args.epochs < 2:
        parser.error("--epoch-batches must be at least 3 and a multiple of --workers (each makes as many), and "
                     "--epochs at least 2")
    from topoclip.config import load_config
    from topoclip.preprocess.tokenizer import Tokenizer

    args.default_buffer = load_config(args.preset).data.shuffle_buffer
    pattern, _ = make_shards(Path(args.shards), args.samples, 256)
    tokenizer = Tokenizer.train(WORDS, vocab_size=256, context_length=load_config(args.preset).model.text.context_length)
    lines = [boundary(pattern, args, tokenizer)] + [one_worker(pattern, args, size, tokenizer) for size in args.shuffle_buffer]
    for line in lines:
        print(json.dumps(line), flush=True)
    summary = {"benchmark": "epoch_start", "preset": args.preset, "batch": args.batch, "workers": args.workers,
               "epoch_batches": args.epoch_batches, "epochs": args.epochs, "machine": platform.platform(),
               "cpu_count": os.cpu_count(), "measurements": lines}
    print(json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
