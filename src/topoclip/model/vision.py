"""ViT image tower with m class tokens: patches → m class tokens + positions → blocks.

Keys match the reference release (``conv1``, ``class_embedding`` (m, w), ``positional_embedding``
(grid² + m, w), ``ln_pre``, ``transformer.resblocks.*``, ``ln_post``, ``proj``).
"""
from __future__ import annotations

import torch
from torch import nn

from topoclip.config.schema import VisionConfig
from topoclip.model.transformer import Transformer, projection


class VisionTransformer(nn.Module):
    """images (B, 3, H, W) -> class-token embeddings (B, m, embed_dim), before the space projection."""

    def __init__(self, config: VisionConfig, class_tokens: int, embed_dim: int):
        super().__init__()
        self.config = config
        self.class_tokens = class_tokens
        width = config.width
        grid = config.image_size // config.patch_size
        scale = width**-0.5
        self.conv1 = nn.Conv2d(3, width, kernel_size=config.patch_size, stride=config.patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.randn(class_tokens, width) * scale)
        self.positional_embedding = nn.Parameter(torch.randn(grid * grid + class_tokens, width) * scale)
        self.ln_pre = nn.LayerNorm(width)
        self.transformer = Transformer(width, config.layers, config.heads, config.mlp_ratio,
                                       config.activation, config.norm_first)
        self.ln_post = nn.LayerNorm(width)
        self.proj = projection(width, embed_dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        expected = self.config.image_size
        if images.shape[-2:] != (expected, expected):
            raise ValueError(f"images are {tuple(images.shape[-2:])} px; this model takes {expected}×{expected} "
                             f"(use the model's transform, or set model.vision.image_size)")
        x = self.conv1(images.to(self.conv1.weight.dtype))  # (B, w, grid, grid)
        x = x.flatten(2).transpose(1, 2)  # (B, grid², w)
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], -1, -1)  # (B, m, w)
        x = torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype)  # (B, m + grid², w)
        x = self.transformer(self.ln_pre(x), output_tokens=self.class_tokens)  # (B, m, w): only class tokens are read
        x = self.ln_post(x)
        return x @ self.proj  # (B, m, embed_dim)
