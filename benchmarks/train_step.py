"""Training-step throughput: forward + backward + AdamW of a preset, one JSON line per measurement.

    python benchmarks/train_step.py --preset openclip-ref --batch 128 --threads 2
    python benchmarks/train_step.py --preset sphere-vit-b16 --batch 256 --device cuda --precision bf16

Inputs are random: images at the preset's size, texts of `--text-length` real tokens (default:
the full context, no padding — the same work a causal CLIP does on every position).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from topoclip.config import load_config
from topoclip.model.clip import CLIP
from topoclip.preprocess.tokenizer import TextBatch
from topoclip.run.training.optim import build_optimizer
from topoclip.run.training.step import forward_backward_loss, optimizer_step


def topoclip_step(preset: str, batch: int, *, device: str = "cpu", precision: str = "fp32", text_length: int = 0,
                  overrides: tuple = (), compile: bool = False, compile_mode: str = "default"):
    """A topoclip training step on random inputs: (step(), model, inputs) where inputs = (images, TextBatch).

    step() runs forward + backward + clip + AdamW (the trainer's forward_backward_loss and
    optimizer_step) and reads nothing on the host: synchronise before reading a clock on a GPU.
    """
    torch.manual_seed(0)
    config = load_config(preset, list(overrides))
    model = CLIP(config.model).to(device).train()
    optimizer = build_optimizer(model, config.train)
    scaler = torch.amp.GradScaler(device) if precision == "fp16" else None
    trained = torch.compile(model, mode=compile_mode) if compile else model
    vision, text = config.model.vision, config.model.text
    images = torch.randn(batch, 3, vision.image_size, vision.image_size, device=device)
    length = text_length or text.context_length
    ids = torch.randint(5, text.vocab_size, (batch, text.context_length), device=device)
    ids[:, 0] = text.cls_token_id
    mask = (torch.arange(text.context_length, device=device)[None, :] < length).expand(batch, -1).contiguous()
    tokens = TextBatch(ids.masked_fill(~mask, 0), mask)

    def step() -> None:
        forward_backward_loss(trained, images, tokens, config.train.loss, precision=precision, scaler=scaler,
                              entailment_weight=config.train.entailment_weight)
        optimizer_step(model, optimizer, scaler, config.train.grad_clip)

    return step, model, (images, tokens)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_steps(step, device: str, steps: int, warmup: int) -> list[float]:
    """Seconds of each of `steps` calls of step() after `warmup` untimed ones (synchronised on a GPU)."""
    for _ in range(warmup):
        step()
    synchronize(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def measure(preset: str, batch: int, *, device: str = "cpu", precision: str = "fp32", threads: int = 0,
            steps: int = 10, warmup: int = 3, text_length: int = 0, overrides: tuple = (), compile: bool = False) -> dict:
    """Time `steps` training steps (after `warmup` untimed ones); returns the figures as a dict."""
    if threads:
        torch.set_num_threads(threads)
    step, model, (_, tokens) = topoclip_step(preset, batch, device=device, precision=precision, text_length=text_length,
                                             overrides=overrides, compile=compile)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times = time_steps(step, device, steps, warmup)
    seconds = sum(times)
    median = sorted(times)[len(times) // 2]  # robust to a noisy neighbour on a shared machine
    result = {
        "benchmark": "train_step", "preset": preset, "overrides": list(overrides), "batch": batch, "device": device,
        "precision": precision, "threads": torch.get_num_threads(), "text_length": int(tokens.attention_mask[0].sum()),
        "steps": steps, "compile": compile, "seconds_per_step": round(seconds / steps, 4),
        "images_per_s": round(batch * steps / seconds, 1), "median_images_per_s": round(batch / median, 1),
        "parameters": sum(p.numel() for p in model.parameters()), "torch": torch.__version__,
    }
    if device.startswith("cuda"):
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        result["gpu"] = torch.cuda.get_device_name()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="openclip-ref")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (0 = torch's default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--text-length", type=int, default=0, help="real tokens per text (0 = full context)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    print(json.dumps(measure(args.preset, args.batch, device=args.device, precision=args.precision,
                             threads=args.threads, steps=args.steps, warmup=args.warmup,
                             text_length=args.text_length, overrides=tuple(args.overrides), compile=args.compile)))


if __name__ == "__main__":
    main()
