"""Training-step speed and model FLOP utilisation (MFU), topoclip next to OpenCLIP's own model, one process.

    python benchmarks/mfu.py --presets sphere-vit-b16,multi-32x16-vit-b16 --batch 256 --precision bf16 [--compile]
    python benchmarks/mfu.py --presets openclip-ref --batch 128 --threads 2 --device cpu        # CPU, fp32

For each preset: images/s of forward + backward + grad clip + AdamW on random inputs (images at the
preset's size, texts of the full context unless --text-length), the FLOPs of one sample's forward +
backward counted by torch.utils.flop_counter (matrix products, convolutions, attention), and
MFU = FLOPs/sample × images/s ÷ the matmul peak *measured in the same run* (a large square matmul
timed: bf16 on a GPU, fp32 on a CPU with the same threads). When `import open_clip` works, OpenCLIP's
model runs beside it: ViT-B-16 for the ViT-B/16 presets, and for `openclip-ref` an open_clip.CLIP
built from the same sizes; every round times each model in turn (alternating), so the noise of
a shared machine hits all alike. One JSON line per round and model, then one summary line per
model with the median over rounds (and the range), and the topoclip / OpenCLIP ratio.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from typing import Callable, Optional

import torch
from torch.utils.flop_counter import FlopCounterMode

from topoclip.run.training.step import set_tf32
from train_step import synchronize, time_steps, topoclip_step

# OpenCLIP's model for each topoclip preset (its name in open_clip, or "custom" for the same sizes).
OPENCLIP_MODELS = {"sphere-vit-b16": "ViT-B-16", "multi-32x16-vit-b16": "ViT-B-16", "openclip-ref": "custom"}


def matmul_peak(device: str, dtype: torch.dtype, size: int = 0, repeats: int = 10) -> float:
    """FLOP/s of the fastest of `repeats` (size × size) @ (size × size) products in `dtype` (2·size³ FLOPs each)."""
    size = size or (8192 if device.startswith("cuda") else 2048)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    synchronize(device)
    best = float("inf")
    inner = 10 if device.startswith("cuda") else 1  # a GPU product is too short to time alone
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            a @ b
        synchronize(device)
        best = min(best, (time.perf_counter() - start) / inner)
    return 2 * size**3 / best


def count_flops(step: Callable[[], None]) -> int:
    """FLOPs of one call of `step` (run eagerly: the same products as the compiled model computes)."""
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def openclip_step(name: str, preset: str, batch: int, *, device: str, precision: str, compile: bool,
                  compile_mode: str = "default"):
    """OpenCLIP's model and loss on random inputs: (step(), eager_step(), model); AdamW + clip 1.0 as topoclip's."""
    import open_clip

    from topoclip.config import load_config
    from topoclip.run.training.step import autocast_context

    torch.manual_seed(0)
    if name == "custom":  # the preset's sizes, built with open_clip's own classes
        model_config = load_config(preset).model
        vision, text = model_config.vision, model_config.text
        model = open_clip.CLIP(
            embed_dim=model_config.embed_dim,
            vision_cfg=open_clip.CLIPVisionCfg(layers=vision.layers, width=vision.width, head_width=vision.width // vision.heads,
                                               patch_size=vision.patch_size, image_size=vision.image_size),
            text_cfg=open_clip.CLIPTextCfg(context_length=text.context_length, vocab_size=text.vocab_size,
                                           width=text.width, heads=text.heads, layers=text.layers))
    else:
        model = open_clip.create_model(name, pretrained=None)
    model = model.to(device).train()
    image_size = model.visual.image_size
    image_size = image_size[0] if isinstance(image_size, (tuple, list)) else image_size
    context, vocab = model.context_length, model.vocab_size
    images = torch.randn(batch, 3, image_size, image_size, device=device)
    ids = torch.randint(1, vocab - 1, (batch, context), device=device)
    ids[:, -1] = vocab - 1  # the end-of-text token: the largest id, where open_clip pools (argmax)
    loss_function = open_clip.ClipLoss()
    fused = {"fused": True} if device.startswith("cuda") else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **fused)
    forward = torch.compile(model, mode=compile_mode) if compile else model

    def run(module) -> None:
        with autocast_context(precision, images.device.type):
            image_features, text_features, logit_scale = module(images, ids)[:3]
        loss = loss_function(image_features.float(), text_features.float(), logit_scale)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return (lambda: run(forward)), (lambda: run(model)), model


class Subject:
    """One model under test: its step, the FLOPs of one sample, and its timings per round."""

    def __init__(self, label: str, preset: str, step: Callable[[], None], flops_step: Callable[[], None],
                 model: torch.nn.Module, batch: int):
        self.label, self.preset, self.step, self.batch = label, preset, step, batch
        self.parameters = sum(p.numel() for p in model.parameters())
        self.flops_per_sample = count_flops(flops_step) / batch
        self.rates: list[float] = []


def build_subjects(args) -> list[Subject]:
    subjects = []
    for preset in args.presets.split(","):
        step, model, inputs = topoclip_step(preset, args.batch, device=args.device, precision=args.precision,
                                            text_length=args.text_length, overrides=tuple(args.overrides),
                                            compile=args.compile, compile_mode=args.compile_mode)
        eager, _, _ = topoclip_step(preset, args.batch, device=args.device, precision=args.precision,
                                    text_length=args.text_length, overrides=tuple(args.overrides),
                                    ) if args.compile else (step, None, None)
        subjects.append(Subject("topoclip", preset, step, eager, model, args.batch))
        name = OPENCLIP_MODELS.get(preset)
        if name and openclip_available():
            step, eager, model = openclip_step(name, preset, args.batch, device=args.device,
                                               precision=args.precision, compile=args.compile,
                                               compile_mode=args.compile_mode)
            subjects.append(Subject(f"open_clip {name}", preset, step, eager, model, args.batch))
    return subjects


def openclip_available() -> bool:
    try:
        importlib.import_module("open_clip")
    except Exception:  # ImportError, or torchvision built for another torch
        return False
    return True


def summary(subject: Subject, peak: float, reference: Optional[Subject], args) -> dict:
    rate = statistics.median(subject.rates)
    result = {
        "benchmark": "mfu", "model": subject.label, "preset": subject.preset, "batch": subject.batch,
        "overrides": args.overrides, "device": args.device, "precision": args.precision, "compile": args.compile and args.compile_mode,
        "tf32": not args.no_tf32, "threads": torch.get_num_threads(), "rounds": len(subject.rates), "median_images_per_s": round(rate, 1),
        "images_per_s_range": [round(min(subject.rates), 1), round(max(subject.rates), 1)],
        "gflop_per_sample": round(subject.flops_per_sample / 1e9, 3), "parameters": subject.parameters,
        "peak_tflop_per_s": round(peak / 1e12, 2), "mfu": round(subject.flops_per_sample * rate / peak, 4),
        "torch": torch.__version__,
    }
    if reference is not None:
        ratios = [ours / theirs for ours, theirs in zip(subject.rates, reference.rates)]
        result["ratio_to_open_clip"] = round(statistics.median(ratios), 3)
        result["ratio_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    if args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="sphere-vit-b16,multi-32x16-vit-b16")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="", choices=["", "fp32", "bf16", "fp16"],
                        help="default: bf16 on a GPU, fp32 on a CPU")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch's default)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (every model once per round)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per model and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per model and round")
    parser.add_argument("--text-length", type=int, default=0, help="real tokens per text (0 = the full context)")
    parser.add_argument("--compile", action="store_true", help="torch.compile every model")
    parser.add_argument("--compile-mode", default="default",
                        choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
                        help="torch.compile's mode (reduce-overhead: CUDA graphs of forward and backward)")
    parser.add_argument("--no-open-clip", action="store_true", help="time topoclip only")
    parser.add_argument("--no-tf32", action="store_true", help="fp32 products in full fp32 (train.allow_tf32=false)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a topoclip setting, e.g. train.fused_optimizer=false")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: pass --device cpu")
    args.precision = args.precision or ("bf16" if cuda else "fp32")
    if args.threads:
        torch.set_num_threads(args.threads)
    if cuda:
        set_tf32(not args.no_tf32)  # train.allow_tf32 (default true)
    if args.no_open_clip:
        OPENCLIP_MODELS.clear()
    elif not openclip_available():
        print(json.dumps({"note": "open_clip does not import here: timing topoclip only"}), flush=True)
    peak = matmul_peak(args.device, torch.bfloat16 if cuda else torch.float32)
    print(json.dumps({"benchmark": "matmul_peak", "device": args.device, "dtype": "bf16" if cuda else "fp32",
                      "tflop_per_s": round(peak / 1e12, 2), "threads": torch.get_num_threads()}), flush=True)
    subjects = build_subjects(args)
    for round_index in range(args.rounds):
        for subject in subjects:
            times = time_steps(subject.step, args.device, args.steps, args.warmup)
            subject.rates.append(subject.batch / statistics.median(times))
            print(json.dumps({"round": round_index, "model": subject.label, "preset": subject.preset,
                              "images_per_s": round(subject.rates[-1], 1)}), flush=True)
    for subject in subjects:
        reference = None
        if subject.label == "topoclip":
            reference = next((other for other in subjects
                              if other.preset == subject.preset and other.label.startswith("open_clip")), None)
        print(json.dumps(summary(subject, peak, reference, args)), flush=True)


if __name__ == "__main__":
    main()
