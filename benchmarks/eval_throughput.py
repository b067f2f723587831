"""Zero-shot evaluation's images/s on a folder of JPEGs, decoding in the main process and in loader workers, against
`topoclip embed` on the same folder: one JSON line.

    python benchmarks/eval_throughput.py --preset cpu-multi --images 2000 --size 256 --workers 2 --threads 2

The folder is ImageNet's layout at small scale (class folders of JPEG files, random pixels, written once); the
model has random weights. Evaluation is timed from its first image to its last (its 10 class prompts are embedded
before); `topoclip embed` with the same batch and workers also writes its shards. A first pass of each warms the
page cache and is not timed. Run it on a quiet machine: it measures speed.
"""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from embed_throughput import arguments, random_model, write_images
from topoclip.data.folders import load_class_folders
from topoclip.run.embed import embed
from topoclip.run.evaluation.zeroshot import evaluating, image_embedding_batches
from topoclip.run.inference import load

CLASSES = 10


def images_per_second(clip, dataset, batch: int, workers: int) -> float:
    with evaluating(clip.model):
        start = time.perf_counter()
        for _ in image_embedding_batches(clip.model, dataset.images, clip.transform, batch, "cpu", workers):
            pass
        return len(dataset.images) / (time.perf_counter() - start)


def main() -> None:
    args = arguments(__doc__)
    work = Path(tempfile.mkdtemp(prefix="eval-bench-"))
    try:
        folder = write_images(work / "images", args.images, args.size, CLASSES)
        checkpoint = random_model(work / "model", args.preset)
        clip = load(checkpoint)
        dataset = load_class_folders(folder)

        images_per_second(clip, dataset, args.batch, args.workers)  # warm-up (page cache)
        main_process = images_per_second(clip, dataset, args.batch, 0)
        workers = images_per_second(clip, dataset, args.batch, args.workers)
        embed(checkpoint, work / "warm", images=str(folder), batch_size=args.batch, shard_size=10_000,
              num_workers=args.workers, progress=False)  # warm-up
        start = time.perf_counter()
        embed(checkpoint, work / "out", images=str(folder), batch_size=args.batch, shard_size=10_000,
              num_workers=args.workers, progress=False)
        bulk = args.images / (time.perf_counter() - start)
        print(json.dumps({"preset": args.preset, "images": args.images, "size": args.size, "batch": args.batch,
                          "threads": args.threads, "workers": args.workers,
                          "eval_main_process_images_per_s": round(main_process, 1),
                          "eval_workers_images_per_s": round(workers, 1), "embed_images_per_s": round(bulk, 1),
                          "eval_workers_over_embed": round(workers / bulk, 3)}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
