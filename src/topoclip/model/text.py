"""BERT-style bidirectional text tower with m class tokens.

The m class tokens are the [CLS] id repeated m times, told apart only by their positions:
input ``[CLS] w1 … [SEP] [PAD]…`` of length L becomes ``[CLS]×m w1 … [SEP] [PAD]…`` of length
L + m − 1. Keys match the reference release (``token_embedding``, ``positional_embedding``,
``ln_embedding``, ``transformer``, ``ln_final``, ``text_projection``) up to the block key map.
OpenAI CLIP's tower is the same with ``attention="causal"`` and ``pooling="end_of_text"``
(topoclip.model.pooling), no embedding LayerNorm and pre-norm blocks.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from topoclip.config.schema import TextConfig
from topoclip.model.pooling import POOLINGS
from topoclip.model.transformer import Transformer, projection


# Eager forward passes on a GPU keep the batch's longest text rounded up to a multiple of this many
# tokens: a handful of shapes instead of one per batch (cuBLAS/cuDNN plans and the caching allocator
# reuse them). On a CPU shapes cost nothing and the trim is exact (bucket 8 measured 12 % slower on
# the openclip-ref text tower with 6–21-token captions: benchmarks/text_trim.py).
LENGTH_BUCKET = 8


def trimmed_length(attention_mask: torch.Tensor, bucket: Optional[int] = None) -> int:
    """Columns of a (B, L) bool mask to keep: the longest text rounded up to a multiple of `bucket`, ≤ L.

    bucket: None = LENGTH_BUCKET on an accelerator, 1 on a CPU. The padding after the kept columns
    is never attended and never read, so dropping it is exact (padding is masked as a key, or follows
    every read token in a causal tower). Reads the mask on the host.
    """
    if bucket is None:
        bucket = 1 if attention_mask.device.type == "cpu" else LENGTH_BUCKET
    longest = int(attention_mask.sum(1).max()) if attention_mask.numel() else 0
    return min(attention_mask.shape[1], max(bucket, -(-longest // bucket) * bucket))


class TextTransformer(nn.Module):
    """token ids (B, L) + attention mask (B, L) -> class-token embeddings (B, m, embed_dim)."""

    def __init__(self, config: TextConfig, class_tokens: int, embed_dim: int):
        super().__init__()
        self.config = config
        self.class_tokens = class_tokens
        width = config.width
        eps = config.layer_norm_eps
        self.token_embedding = nn.Embedding(config.vocab_size, width)
        self.positional_embedding = nn.Parameter(torch.empty(config.context_length + class_tokens - 1, width))
        self.ln_embedding = nn.LayerNorm(width, eps=eps) if config.embedding_norm else nn.Identity()
        self.causal = config.attention == "causal"
        self.transformer = Transformer(width, config.layers, config.heads, config.mlp_ratio,
                                       config.activation, config.norm_first, self.causal, eps)
        self.pooling = POOLINGS[config.pooling](class_tokens, config)
        self.ln_final = nn.LayerNorm(width, eps=eps)
        self.text_projection = projection(width, embed_dim)
        # SigLIP's text head is a biased linear layer: x @ text_projection + text_projection_bias.
        self.text_projection_bias = nn.Parameter(torch.zeros(embed_dim)) if config.projection_bias else None
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.01)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        length = input_ids.shape[1]
        if length > self.config.context_length:
            raise ValueError(f"text has {length} tokens; the model's context is {self.config.context_length} "
                             f"(tokenize with context_length={self.config.context_length})")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        attention_mask = attention_mask.bool()
        if self.pooling.attends_padding:  # SigLIP's layout reads the whole padded context, padding unmasked
            if length != self.config.context_length:
                raise ValueError(f"text has {length} tokens; this model reads texts padded to its full context of "
                                 f"{self.config.context_length} (tokenize with the model's tokenizer)")
            return self.encode_tokens(input_ids, attention_mask, padded=False)
        if torch.compiler.is_compiling():
            # Under torch.compile the context stays fixed: reading the mask on the host would break
            # the graph, and a length per batch would recompile it. Padding is masked: exact.
            return self.encode_tokens(input_ids, attention_mask, padded=True)
        used = trimmed_length(attention_mask)
        input_ids, attention_mask = input_ids[:, :used], attention_mask[:, :used]
        # No mask when nothing is padded: SDPA then takes its fastest kernel.
        return self.encode_tokens(input_ids, attention_mask, padded=not bool(attention_mask.all()))

    def encode_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, padded: bool = True) -> torch.Tensor:
        """ids (B, L), mask (B, L) bool as given -> (B, m, embed_dim); no branch on values (traceable).

        padded=False promises that the mask is all True (no key mask is applied); a tower pooled at the last position
        (SigLIP's) never masks: its padding is attended.
        """
        ids, mask = self.pooling.insert(input_ids, attention_mask)  # (B, L + m − 1)
        x = self.token_embedding(ids) + self.positional_embedding[: ids.shape[1]]  # (B, L + m − 1, w)
        x = self.ln_embedding(x)
        key_mask = mask if padded and not self.causal and not self.pooling.attends_padding else None
        x = self.transformer(x, key_mask, output_tokens=self.pooling.output_tokens)  # (B, m or L + m − 1, w)
        x = self.ln_final(self.pooling.select(x, ids))  # (B, m, w)
        x = x @ self.text_projection  # (B, m, embed_dim)
        return x if self.text_projection_bias is None else x + self.text_projection_bias.to(x.dtype)
