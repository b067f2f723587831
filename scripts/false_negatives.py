"""How often a batch of the built-in scenes holds a false negative: a caption true of another image of the batch.

    python scripts/false_negatives.py > docs/results/false-negatives.json

The captions are partial ("a black object"), so a caption is often true of other scenes than its own. InfoNCE
averages over all negatives; VSE++'s max of hinges trains on the hardest one alone, which is then often a true
match. Batches are drawn as training draws them (without replacement from the train split).
"""
import argparse
import json

import numpy as np

from topoclip.config import load_config
from topoclip.data.scenes.dataset import SceneDataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu-multi")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    dataset = SceneDataset(load_config(args.preset).data.scenes, "train")
    rng = np.random.default_rng(args.seed)
    text, image, text_count, image_count, duplicate = [], [], [], [], []
    for _ in range(args.batches):
        indices = rng.choice(len(dataset), args.batch_size, replace=False)
        negatives = dataset.true_pairs(indices) & ~np.eye(args.batch_size, dtype=bool)
        captions = [dataset.paired_caption(i).text for i in indices]
        text.append(negatives.any(1).mean())  # a caption as the query: another image it is true of
        image.append(negatives.any(0).mean())  # an image as the query: another caption true of it
        text_count.append(negatives.sum(1).mean())
        image_count.append(negatives.sum(0).mean())
        duplicate.append(np.mean([captions.count(c) > 1 for c in captions]))
    result = {"preset": args.preset, "split": "train", "batch_size": args.batch_size, "batches": args.batches,
              "seed": args.seed,
              "text_queries_with_a_false_negative": float(np.mean(text)),
              "image_queries_with_a_false_negative": float(np.mean(image)),
              "false_negatives_per_text_query": float(np.mean(text_count)),
              "false_negatives_per_image_query": float(np.mean(image_count)),
              "queries_whose_caption_has_an_exact_duplicate": float(np.mean(duplicate))}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
