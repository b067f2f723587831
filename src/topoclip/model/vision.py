"""ViT image tower with m output tokens, made in one of two ways (``model.vision.pooling``):

- ``"class_tokens"`` (ViT, CLIP, the paper's): patches → m class tokens + positions → blocks; the m class tokens
  are read. Keys match the reference release (``conv1``, ``class_embedding`` (m, w), ``positional_embedding``
  (grid² + m, w), ``ln_pre``, ``transformer.resblocks.*``, ``ln_post``, ``proj``).
- ``"attention"`` (SigLIP's attention-pooling head, "MAP"): patches + positions (grid², w) → blocks → ``ln_post`` on
  every patch → m learned queries (``head.probe`` (m, w)) attend to the patches → x + MLP(LayerNorm(x)) → ``proj``.
  SigLIP has one query; m queries are its multi-token form, as m class tokens are CLIP's.
"""
from __future__ import annotations

import torch
from torch import nn

from topoclip.config.schema import VisionConfig
from topoclip.model.transformer import MLP, Attention, Transformer, projection


class AttentionPooling(nn.Module):
    """SigLIP's attention-pooling head with m queries: (B, L, w) -> (B, m, w)."""

    def __init__(self, tokens: int, width: int, heads: int, mlp_ratio: float, activation: str, eps: float):
        super().__init__()
        self.probe = nn.Parameter(torch.randn(tokens, width) * width**-0.5)
        self.attn = Attention(width, heads)
        self.layernorm = nn.LayerNorm(width, eps=eps)
        self.mlp = MLP(width, int(width * mlp_ratio), activation)
        nn.init.normal_(self.attn.in_proj_weight, std=width**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probe = self.probe.to(x.dtype).expand(x.shape[0], -1, -1)  # (B, m, w)
        x = self.attn(x, queries=probe)  # (B, m, w)
        return x + self.mlp(self.layernorm(x))


class VisionTransformer(nn.Module):
    """images (B, 3, H, W) -> class-token embeddings (B, m, embed_dim), before the space projection."""

    def __init__(self, config: VisionConfig, class_tokens: int, embed_dim: int):
        super().__init__()
        self.config = config
        self.class_tokens = class_tokens
        width = config.width
        grid = config.image_size // config.patch_size
        scale = width**-0.5
        eps = config.layer_norm_eps
        self.attention_pooling = config.pooling == "attention"
        self.conv1 = nn.Conv2d(3, width, kernel_size=config.patch_size, stride=config.patch_size, bias=config.patch_bias)
        if not self.attention_pooling:
            self.class_embedding = nn.Parameter(torch.randn(class_tokens, width) * scale)
        prepended = 0 if self.attention_pooling else class_tokens
        self.positional_embedding = nn.Parameter(torch.randn(grid * grid + prepended, width) * scale)
        self.ln_pre = nn.LayerNorm(width, eps=eps) if config.pre_norm else nn.Identity()
        self.transformer = Transformer(width, config.layers, config.heads, config.mlp_ratio,
                                       config.activation, config.norm_first, eps=eps)
        self.ln_post = nn.LayerNorm(width, eps=eps)
        if self.attention_pooling:
            self.head = AttentionPooling(class_tokens, width, config.heads, config.mlp_ratio, config.activation, eps)
        self.proj = projection(width, embed_dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        expected = self.config.image_size
        if images.shape[-2:] != (expected, expected):
            raise ValueError(f"images are {tuple(images.shape[-2:])} px; this model takes {expected}×{expected} "
                             f"(use the model's transform, or set model.vision.image_size)")
        x = self.conv1(images.to(self.conv1.weight.dtype))  # (B, w, grid, grid)
        x = x.flatten(2).transpose(1, 2)  # (B, grid², w)
        if self.attention_pooling:
            x = self.transformer(self.ln_pre(x + self.positional_embedding.to(x.dtype)))  # (B, grid², w)
            return self.head(self.ln_post(x)) @ self.proj  # (B, m, embed_dim)
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], -1, -1)  # (B, m, w)
        x = torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype)  # (B, m + grid², w)
        x = self.transformer(self.ln_pre(x), output_tokens=self.class_tokens)  # (B, m, w): only class tokens are read
        x = self.ln_post(x)
        return x @ self.proj  # (B, m, embed_dim)
