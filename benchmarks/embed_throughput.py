"""`topoclip embed` against a plain `encode_image` loop on the same images: images/s, one JSON line.

    python benchmarks/embed_throughput.py --preset cpu-multi --images 2000 --size 256 --workers 2 --threads 2

Both embed the same JPEG files (written once, random pixels) with the same model (random weights) and
batch size. The loop is what a user writes first: `clip.encode_image(paths[i:i + batch])`, decoding in
the main process; `topoclip embed` decodes in --workers processes while the model runs, and writes
shards. The first batch of each is a warm-up and is not timed.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from topoclip.io.checkpoint import save_checkpoint
from topoclip.config import load_config
from topoclip.run.embed import embed
from topoclip.run.inference import load
from topoclip.model.clip import CLIP
from topoclip.preprocess.tokenizer import Tokenizer
from topoclip.run.training.tokenizer_setup import fit_to_trained_tokenizer


def write_images(folder: Path, count: int, size: int, classes: int = 1) -> Path:
    """`count` JPEG files of random pixels (size × size) in `classes` class folders (one: the folder itself)."""
    rng = np.random.default_rng(0)
    for index in range(count):
        target = folder / f"class{index % classes}" if classes > 1 else folder
        target.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(target / f"{index:06d}.jpg", quality=90)
    return folder


def random_model(folder: Path, preset: str) -> Path:
    """A checkpoint of `preset` with random weights and a tiny vocabulary."""
    config = load_config(preset)
    tokenizer = Tokenizer.train(["a photo"], vocab_size=64, context_length=config.model.text.context_length)
    config = fit_to_trained_tokenizer(config, tokenizer)  # as the trainer does (a loaded Config is frozen)
    return save_checkpoint(folder, CLIP(config.model), config, tokenizer)


def arguments(doc: str) -> argparse.Namespace:
    """The command line both image benchmarks take (and torch's threads set from it)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--preset", default="cpu-multi")
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--size", type=int, default=256, help="side of the JPEG files")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args


def main() -> None:
    args = arguments(__doc__)
    work = Path(tempfile.mkdtemp(prefix="embed-bench-"))
    try:
        folder = write_images(work / "images", args.images, args.size)
        checkpoint = random_model(work / "model", args.preset)
        clip = load(checkpoint)
        paths = sorted(folder.rglob("*.jpg"))

        clip.encode_image(paths[:args.batch], args.batch)  # warm-up
        start = time.perf_counter()
        for i in range(args.batch, len(paths), args.batch):
            clip.encode_image(paths[i:i + args.batch], args.batch)
        loop = (len(paths) - args.batch) / (time.perf_counter() - start)

        embed(checkpoint, work / "warm", images=str(folder), batch_size=args.batch,
              shard_size=args.batch, num_workers=args.workers, progress=False)  # warm-up (page cache, workers)
        start = time.perf_counter()
        embed(checkpoint, work / "out", images=str(folder), batch_size=args.batch, shard_size=10_000,
              num_workers=args.workers, progress=False)
        bulk = len(paths) / (time.perf_counter() - start)
        print(json.dumps({"preset": args.preset, "images": len(paths), "size": args.size, "batch": args.batch,
                          "threads": args.threads, "workers": args.workers,
                          "encode_image_loop_images_per_s": round(loop, 1), "embed_images_per_s": round(bulk, 1),
                          "ratio": round(bulk / loop, 3)}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
