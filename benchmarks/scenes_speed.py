"""Rendering speed of the built-in scenes, single-threaded: prints {"images_per_s": ..., "image_size": ...}.

Times `SceneDataset.__getitem__` (scene sampling + rendering + caption), the work one DataLoader worker
does per sample. Usage: python benchmarks/scenes_speed.py [--image-size 32] [--count 5000] [--style in-domain]
"""
import argparse
import json
import time

import torch

from topoclip.data.scenes import STYLES, SceneConfig, SceneDataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--count", type=int, default=5000, help="images to render")
    parser.add_argument("--style", choices=STYLES, default="in-domain")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dataset = SceneDataset(SceneConfig(image_size=args.image_size, train_size=args.count, style=args.style), "train")
    for i in range(min(50, args.count)):  # warm-up: caches, lazy imports
        dataset[i]
    start = time.perf_counter()
    for i in range(args.count):
        dataset[i]
    seconds = time.perf_counter() - start
    print(json.dumps({"images_per_s": round(args.count / seconds, 1), "image_size": args.image_size}))


if __name__ == "__main__":
    main()
