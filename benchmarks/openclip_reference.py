"""Side-by-side CPU training speed: topoclip's sphere model vs an OpenCLIP-architecture CLIP.

open_clip itself cannot be imported here (it needs torchvision), so `OpenClipStyle` rebuilds its
ViT-text CLIP from the same torch modules open_clip uses (nn.MultiheadAttention, pre-norm residual
blocks, GELU MLPs, a causal text transformer pooled at the end-of-text token, cosine similarity).
Both models run the `openclip-ref` configuration (image 64 px / patch 8, 192 × 6; text 192 × 4,
context 32, vocab 1,024; embedding 128; batch 128) with AdamW on the same inputs, alternating,
so a noisy machine affects both alike. Prints one JSON line per round and a summary line.

    python benchmarks/openclip_reference.py --rounds 3 --threads 2
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch import nn

from train_step import measure


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


def measure_reference(batch: int, steps: int, warmup: int) -> float:
    torch.manual_seed(0)
    model = OpenClipStyle()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    images = torch.randn(batch, 3, 64, 64)
    ids = torch.randint(1, 1023, (batch, 32))
    ids[:, -1] = 1023  # end-of-text: the highest id, where open_clip pools
    times = []
    for index in range(warmup + steps):
        start = time.perf_counter()
        loss = model(images, ids)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return batch / sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ratios = []
    for round_index in range(args.rounds):
        reference = measure_reference(args.batch, args.steps, args.warmup)
        ours = measure("openclip-ref", args.batch, threads=args.threads, steps=args.steps, warmup=args.warmup)
        ratios.append(ours["median_images_per_s"] / reference)
        print(json.dumps({"round": round_index, "openclip_style_images_per_s": round(reference, 1),
                          "topoclip_images_per_s": ours["median_images_per_s"], "ratio": round(ratios[-1], 3)}), flush=True)
    print(json.dumps({"benchmark": "openclip_reference", "median_ratio": round(sorted(ratios)[len(ratios) // 2], 3),
                      "threads": args.threads, "batch": args.batch}))


if __name__ == "__main__":
    main()
