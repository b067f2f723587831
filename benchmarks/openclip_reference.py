"""Side-by-side CPU training speed: topoclip's `openclip-ref` sphere model vs OpenCLIP's own CLIP.

Both run the `openclip-ref` configuration (image 64 px / patch 8, 192 × 6; text 192 × 4, context 32,
vocab 1,024; embedding 128; batch 128) with AdamW on random inputs, alternating round by round, so a
noisy machine affects both alike. Prints one JSON line per round and a summary line (median ratio
and its range).

The reference is the real `open_clip.CLIP` (built from these sizes with open_clip's own classes)
whenever `import open_clip` works — e.g. in a venv with the CUDA build of torch, torchvision and
open_clip_torch (README, Benchmarks). Only where it does not import does it fall back to
`OpenClipStyle`, a REBUILD of open_clip's ViT-text CLIP from the same torch modules (pre-norm
nn.MultiheadAttention blocks, GELU MLPs, a causal text tower pooled at the end-of-text token); the
output then says `"reference": "rebuild"`.

    python benchmarks/openclip_reference.py --rounds 3 --threads 2
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch import nn

from mfu import openclip_available, openclip_step
from train_step import time_steps, topoclip_step


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x, attn_mask=None):
        y = self.ln_1(x)
        x = x + self.attn(y, y, y, need_weights=False, attn_mask=attn_mask)[0]
        return x + self.mlp(self.ln_2(x))


class OpenClipStyle(nn.Module):
    """The fallback REBUILD of open_clip's CLIP at the openclip-ref sizes (used only when open_clip does not import)."""

    def __init__(self, image=64, patch=8, width=192, layers=6, text_width=192, text_layers=4, context=32,
                 vocab=1024, embed=128):
        super().__init__()
        grid = image // patch
        self.conv1 = nn.Conv2d(3, width, patch, patch, bias=False)
        self.class_embedding = nn.Parameter(torch.randn(width) * width**-0.5)
        self.positional_embedding = nn.Parameter(torch.randn(grid * grid + 1, width) * width**-0.5)
        self.ln_pre, self.ln_post = nn.LayerNorm(width), nn.LayerNorm(width)
        self.visual = nn.ModuleList(Block(width, width // 64) for _ in range(layers))
        self.proj = nn.Parameter(torch.randn(width, embed) * width**-0.5)
        self.token_embedding = nn.Embedding(vocab, text_width)
        self.text_positional = nn.Parameter(torch.randn(context, text_width) * 0.01)
        self.text = nn.ModuleList(Block(text_width, text_width // 64) for _ in range(text_layers))
        self.ln_final = nn.LayerNorm(text_width)
        self.text_projection = nn.Parameter(torch.randn(text_width, embed) * text_width**-0.5)
        self.register_buffer("causal", torch.full((context, context), float("-inf")).triu(1), persistent=False)
        self.logit_scale = nn.Parameter(torch.tensor(2.659))

    def forward(self, images, ids):
        x = self.conv1(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], 1) + self.positional_embedding
        x = self.ln_pre(x)
        for block in self.visual:
            x = block(x)
        image = F.normalize(self.ln_post(x[:, 0]) @ self.proj, dim=-1)
        t = self.token_embedding(ids) + self.text_positional
        for block in self.text:
            t = block(t, self.causal)
        t = self.ln_final(t)
        text = F.normalize(t[torch.arange(t.shape[0]), ids.argmax(-1)] @ self.text_projection, dim=-1)
        logits = self.logit_scale.exp() * image @ text.T
        labels = torch.arange(logits.shape[0])
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def rebuild_step(batch: int):
    """FALLBACK reference (open_clip not importable): the rebuild's training step on random inputs."""
    torch.manual_seed(0)
    model = OpenClipStyle()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    images = torch.randn(batch, 3, 64, 64)
    ids = torch.randint(1, 1023, (batch, 32))
    ids[:, -1] = 1023  # end-of-text: the highest id, where open_clip pools

    def step() -> None:
        loss = model(images, ids)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step


def reference_step(batch: int):
    """(step, label): open_clip's own CLIP at the openclip-ref sizes, or the rebuild where open_clip does not import."""
    if openclip_available():
        import open_clip

        step, _, _ = openclip_step("custom", "openclip-ref", batch, device="cpu", precision="fp32", compile=False)
        return step, f"open_clip {open_clip.__version__}"
    return rebuild_step(batch), "rebuild"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reference, label = reference_step(args.batch)
    ours, _, _ = topoclip_step("openclip-ref", args.batch)
    ratios = []
    for round_index in range(args.rounds):
        theirs = args.batch / statistics.median(time_steps(reference, "cpu", args.steps, args.warmup))
        mine = args.batch / statistics.median(time_steps(ours, "cpu", args.steps, args.warmup))
        ratios.append(mine / theirs)
        print(json.dumps({"round": round_index, "reference": label, "reference_images_per_s": round(theirs, 1),
                          "topoclip_images_per_s": round(mine, 1), "ratio": round(ratios[-1], 3)}), flush=True)
    print(json.dumps({"benchmark": "openclip_reference", "reference": label, "torch": torch.__version__,
                      "median_ratio": round(statistics.median(ratios), 3),
                      "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
                      "threads": args.threads, "batch": args.batch}))


if __name__ == "__main__":
    main()
