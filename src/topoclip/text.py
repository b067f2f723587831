"""BERT-style bidirectional text tower with m class tokens (SPEC §6).

The m class tokens are the [CLS] id repeated m times, told apart only by their positions:
input ``[CLS] w1 … [SEP] [PAD]…`` of length L becomes ``[CLS]×m w1 … [SEP] [PAD]…`` of length
L + m − 1. Keys match the reference release (``token_embedding``, ``positional_embedding``,
``ln_embedding``, ``transformer``, ``ln_final``, ``text_projection``) up to the block key map.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from topoclip.config import TextConfig
from topoclip.transformer import Transformer, projection


class TextTransformer(nn.Module):
    """token ids (B, L) + attention mask (B, L) -> class-token embeddings (B, m, embed_dim)."""

    def __init__(self, config: TextConfig, class_tokens: int, embed_dim: int):
        super().__init__()
        self.config = config
        self.class_tokens = class_tokens
        width = config.width
        self.token_embedding = nn.Embedding(config.vocab_size, width)
        self.positional_embedding = nn.Parameter(torch.empty(config.context_length + class_tokens - 1, width))
        self.ln_embedding = nn.LayerNorm(width) if config.embedding_norm else nn.Identity()
        self.transformer = Transformer(width, config.layers, config.heads, config.mlp_ratio,
                                       config.activation, config.norm_first)
        self.ln_final = nn.LayerNorm(width)
        self.text_projection = projection(width, embed_dim)
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.01)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        batch, length = input_ids.shape
        if length > self.config.context_length:
            raise ValueError(f"text has {length} tokens; the model's context is {self.config.context_length} "
                             f"(tokenize with context_length={self.config.context_length})")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        attention_mask = attention_mask.bool()
        # Padding after the longest text in the batch is never attended and never read: drop it.
        # Exact, since attention is bidirectional with a key mask and only positions < m are read.
        used = max(int(attention_mask.sum(1).max()), 1)
        input_ids, attention_mask = input_ids[:, :used], attention_mask[:, :used]
        m = self.class_tokens
        cls = torch.full((batch, m - 1), self.config.cls_token_id, dtype=input_ids.dtype, device=input_ids.device)
        ids = torch.cat([cls, input_ids], dim=1)  # (B, L' + m − 1): [CLS]×m w1 …
        mask = torch.cat([attention_mask.new_ones(batch, m - 1), attention_mask], dim=1)
        x = self.token_embedding(ids) + self.positional_embedding[: ids.shape[1]]  # (B, L' + m − 1, w)
        x = self.ln_embedding(x)
        # No mask when nothing is padded: SDPA then takes its fastest kernel.
        x = self.transformer(x, None if bool(mask.all()) else mask, output_tokens=m)  # (B, m, w)
        x = self.ln_final(x)
        return x @ self.text_projection  # (B, m, embed_dim)
