"""Where a training step of the default CPU run goes: model vs rendering vs augmentation vs tokenising.

    python benchmarks/step_split.py [--preset cpu-multi] [--threads 2] [--rounds 5]

Times, per batch of the preset's size and in the same process (interleaved rounds, medians): the model's
forward + backward + AdamW on random inputs; the in-memory stream's work (index, batched crop-resize,
tokenise); and, for comparison, what a streaming loader would do per batch (render each scene, PIL crop).
Prints one JSON line; milliseconds per step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from topoclip.config import load_config
from topoclip.data.batch import derived_seed
from topoclip.data.scenes import SceneDataset
from topoclip.model.clip import CLIP
from topoclip.preprocess.tokenizer import Tokenizer
from topoclip.data.scene_batches import RenderedScenes
from topoclip.run.training.optim import build_optimizer
from topoclip.run.training.step import forward_backward, optimizer_step
from topoclip.preprocess.transforms import RandomResizedCrop, resized_crops, train_transform


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu-multi")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = load_config(args.preset)
    vision, batch = config.model.vision, config.train.batch_size
    scenes = SceneDataset(config.data.scenes, "train")
    rendered = RenderedScenes(scenes, torch.arange(4 * batch), workers=0)
    tokenizer = Tokenizer.train(rendered.captions, vocab_size=config.model.text.vocab_size,
                                context_length=config.model.text.context_length)
    model = CLIP(config.model)
    optimizer = build_optimizer(model, config.train)
    generator = torch.Generator()
    crop = RandomResizedCrop(vision.image_size, scale=config.data.augment_scale, generator=generator)
    pil_transform = train_transform(vision.image_size, vision.mean, vision.std, scale=config.data.augment_scale,
                                    generator=generator)
    images = resized_crops(rendered.images[:batch], torch.tensor([[0, 0, 32, 32]] * batch), vision.image_size)
    text = tokenizer(rendered.captions[:batch])

    def model_step():
        forward_backward(model, images, text, config.train.loss, precision=config.train.precision)
        optimizer_step(model, optimizer, None, config.train.grad_clip)

    def crop_batch():
        boxes = []
        for index in range(batch):
            generator.manual_seed(derived_seed(0, 0, index))
            boxes.append(crop.get_params(32, 32))
        resized_crops(rendered.images[:batch], torch.tensor(boxes), vision.image_size, vision.mean, vision.std)

    def tokenise():
        tokenizer(rendered.captions[:batch])

    def render_stream():
        for index in range(batch):
            scenes[index]

    def pil_crops():
        for image in rendered.images[:batch].permute(0, 2, 3, 1).numpy():
            pil_transform(image)

    parts = {"model (forward + backward + AdamW)": model_step, "batched crop-resize": crop_batch,
             "tokenise": tokenise, "render (streaming loaders only)": render_stream,
             "PIL crop per image (streaming loaders only)": pil_crops}
    times = {name: [] for name in parts}
    for _ in range(args.rounds):
        for name, work in parts.items():
            work()
            start = time.perf_counter()
            work()
            times[name].append(1000 * (time.perf_counter() - start))
    print(json.dumps({"benchmark": "step_split", "preset": args.preset, "batch": batch, "threads": args.threads,
                      "ms_per_step": {name: round(statistics.median(v), 1) for name, v in times.items()}}))


if __name__ == "__main__":
    main()
