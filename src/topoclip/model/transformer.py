"""Transformer blocks shared by both towers: attention with packed q/k/v, MLP, pre- or post-norm.

Parameter names follow torch's ``nn.MultiheadAttention`` packing (``attn.in_proj_weight`` (3w, w),
``attn.out_proj``) and OpenAI CLIP's block layout (``ln_1``, ``mlp.c_fc``, ``mlp.c_proj``, ``ln_2``),
so importing the reference release or OpenAI/OpenCLIP weights is a key map.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class QuickGELU(nn.Module):
    """x·σ(1.702x), the activation of OpenAI's CLIP weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


def TanhGELU() -> nn.Module:
    """GELU by its tanh approximation: SigLIP's ("gelu_pytorch_tanh" in transformers, jax's default gelu)."""
    return nn.GELU(approximate="tanh")


ACTIVATIONS = {"gelu": nn.GELU, "quick_gelu": QuickGELU, "gelu_tanh": TanhGELU}
# LayerNorm's ε when a tower does not set its own (model.*.layer_norm_eps): torch's default, OpenAI's and OpenCLIP's.
LAYER_NORM_EPS = 1e-5


class Attention(nn.Module):
    """Multi-head self-attention on `F.scaled_dot_product_attention`, with a key-padding mask.

    causal: position i attends to positions ≤ i only (OpenAI CLIP's text tower); then there is no
    key mask: padding follows every real token, so no real token can attend to it.
    """

    def __init__(self, width: int, heads: int, causal: bool = False):
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, key_mask: Optional[torch.Tensor] = None, queries: int = 0) -> torch.Tensor:
        """x (B, L, w); key_mask (B, L) bool, True where a key may be attended -> (B, L, w).

        queries > 0: only the first `queries` positions attend (keys and values still come from all
        L), and the output is (B, queries, w). queries a tensor (B, Q, w): those attend to x instead (the
        attention-pooling head's learned queries), and the output is (B, Q, w).
        """
        batch, length, width = x.shape
        head_width = width // self.heads
        if isinstance(queries, torch.Tensor):  # cross-attention: given queries (B, Q, w) attend to x
            q = F.linear(queries, self.in_proj_weight[:width], self.in_proj_bias[:width])  # (B, Q, w)
            kv = F.linear(x, self.in_proj_weight[width:], self.in_proj_bias[width:])  # (B, L, 2w)
            q = q.view(batch, -1, self.heads, head_width).transpose(1, 2)  # (B, h, Q, w/h)
            k, v = kv.view(batch, length, 2, self.heads, head_width).permute(2, 0, 3, 1, 4)  # 2 × (B, h, L, w/h)
        elif queries:
            q = F.linear(x[:, :queries], self.in_proj_weight[:width], self.in_proj_bias[:width])  # (B, Q, w)
            kv = F.linear(x, self.in_proj_weight[width:], self.in_proj_bias[width:])  # (B, L, 2w)
            q = q.view(batch, queries, self.heads, head_width).transpose(1, 2)  # (B, h, Q, w/h)
            k, v = kv.view(batch, length, 2, self.heads, head_width).permute(2, 0, 3, 1, 4)  # 2 × (B, h, L, w/h)
        else:
            qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)  # (B, L, 3w)
            q, k, v = qkv.view(batch, length, 3, self.heads, head_width).permute(2, 0, 3, 1, 4)  # 3 × (B, h, L, w/h)
        mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, L) broadcast over heads, queries
        # is_causal keeps query i to keys ≤ i (top-left aligned, so also right for the first Q queries).
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)  # (B, h, Q or L, w/h)
        return self.out_proj(y.transpose(1, 2).reshape(batch, -1, width))


class MLP(nn.Module):
    def __init__(self, width: int, hidden: int, activation: str):
        super().__init__()
        self.c_fc = nn.Linear(width, hidden)
        self.activation = ACTIVATIONS[activation]()
        self.c_proj = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.activation(self.c_fc(x)))


class Block(nn.Module):
    """Residual block: pre-norm x + f(ln(x)) (ViT) or post-norm ln(x + f(x)) (BERT)."""

    def __init__(self, width: int, heads: int, mlp_ratio: float, activation: str, norm_first: bool,
                 causal: bool = False, eps: float = LAYER_NORM_EPS):
        super().__init__()
        self.norm_first = norm_first
        self.ln_1 = nn.LayerNorm(width, eps=eps)
        self.attn = Attention(width, heads, causal)
        self.ln_2 = nn.LayerNorm(width, eps=eps)
        self.mlp = MLP(width, int(width * mlp_ratio), activation)

    def forward(self, x: torch.Tensor, key_mask: Optional[torch.Tensor] = None, queries: int = 0) -> torch.Tensor:
        """x (B, L, w) -> (B, L, w), or (B, queries, w) when only the first `queries` outputs are wanted."""
        kept = x[:, :queries] if queries else x
        if self.norm_first:
            kept = kept + self.attn(self.ln_1(x), key_mask, queries)
            return kept + self.mlp(self.ln_2(kept))
        kept = self.ln_1(kept + self.attn(x, key_mask, queries))
        return self.ln_2(kept + self.mlp(kept))


class Transformer(nn.Module):
    """A stack of blocks; `gradient_checkpointing` recomputes each block in backward."""

    def __init__(self, width: int, layers: int, heads: int, mlp_ratio: float = 4.0,
                 activation: str = "gelu", norm_first: bool = True, causal: bool = False, eps: float = LAYER_NORM_EPS):
        super().__init__()
        self.resblocks = nn.ModuleList(Block(width, heads, mlp_ratio, activation, norm_first, causal, eps)
                                       for _ in range(layers))
        self.gradient_checkpointing = False
        self.init_weights(width, layers)

    def init_weights(self, width: int, layers: int) -> None:
        # OpenCLIP's scheme: residual outputs scaled down with depth.
        attention_std = width**-0.5
        projection_std = width**-0.5 * (2 * layers) ** -0.5
        hidden_std = (2 * width) ** -0.5
        for block in self.resblocks:
            nn.init.normal_(block.attn.in_proj_weight, std=attention_std)
            nn.init.normal_(block.attn.out_proj.weight, std=projection_std)
            nn.init.zeros_(block.attn.out_proj.bias)
            nn.init.normal_(block.mlp.c_fc.weight, std=hidden_std)
            nn.init.zeros_(block.mlp.c_fc.bias)
            nn.init.normal_(block.mlp.c_proj.weight, std=projection_std)
            nn.init.zeros_(block.mlp.c_proj.bias)

    def forward(self, x: torch.Tensor, key_mask: Optional[torch.Tensor] = None, output_tokens: int = 0) -> torch.Tensor:
        """x (B, L, w) -> (B, L, w); with output_tokens = m, (B, m, w): the first m positions only.

        When the caller reads only the first m positions (the class tokens), the last block computes
        just those rows (queries, MLP); keys and values still use every position, so the result is
        exactly the full computation's first m rows, for ~(1 − m/L) of the last block's cost.
        """
        last = len(self.resblocks) - 1
        for index, block in enumerate(self.resblocks):
            queries = output_tokens if index == last else 0
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, key_mask, queries, use_reentrant=False)
            else:
                x = block(x, key_mask, queries)
        return x


def projection(width: int, out_dim: int) -> nn.Parameter:
    """(width, out_dim) projection used as x @ proj; Gaussian, mean 0, std 1/sqrt(fan_in)."""
    return nn.Parameter(torch.randn(width, out_dim) * width**-0.5)
