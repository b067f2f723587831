"""Foreign CLIP models written from torch primitives, in the layouts topoclip imports.

They follow the original code's forward passes, not topoclip's: torch's nn.MultiheadAttention in
(L, B, w) layout and nn.TransformerEncoder, the authors' [CLS]×m text tokens, OpenAI's causal
mask and argmax pooling. Every parameter is random (LayerNorms included), so a wrong key map or a
wrong block order shows up in the embeddings.
"""
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn


class QuickGELU(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class ResidualAttentionBlock(nn.Module):
    """OpenAI's pre-norm block: x + attn(ln_1(x)), then x + mlp(ln_2(x)); x is (L, B, w)."""

    def __init__(self, width, heads, activation, attn_mask=None):
        super().__init__()
        self.attn = nn.MultiheadAttention(width, heads)
        self.ln_1 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(OrderedDict([("c_fc", nn.Linear(width, width * 4)), ("gelu", activation()),
                                              ("c_proj", nn.Linear(width * 4, width))]))
        self.ln_2 = nn.LayerNorm(width)
        self.attn_mask = attn_mask

    def forward(self, x):
        y = self.ln_1(x)
        mask = None if self.attn_mask is None else self.attn_mask[: x.shape[0], : x.shape[0]]
        x = x + self.attn(y, y, y, need_weights=False, attn_mask=mask)[0]
        return x + self.mlp(self.ln_2(x))


class Resblocks(nn.Module):
    def __init__(self, width, layers, heads, activation, attn_mask=None):
        super().__init__()
        self.resblocks = nn.Sequential(*[ResidualAttentionBlock(width, heads, activation, attn_mask) for _ in range(layers)])

    def forward(self, x):
        return self.resblocks(x)


class VisionTransformer(nn.Module):
    """The image tower of both releases; `tokens` class tokens ((width,) when OpenAI's single one)."""

    def __init__(self, image_size, patch, width, layers, heads, embed_dim, tokens, activation, openai_shape=False):
        super().__init__()
        self.tokens = tokens
        self.conv1 = nn.Conv2d(3, width, patch, patch, bias=False)
        self.class_embedding = nn.Parameter(torch.randn(width) if openai_shape else torch.randn(tokens, width))
        self.positional_embedding = nn.Parameter(torch.randn((image_size // patch) ** 2 + tokens, width))
        self.ln_pre = nn.LayerNorm(width)
        self.transformer = Resblocks(width, layers, heads, activation)
        self.ln_post = nn.LayerNorm(width)
        self.proj = nn.Parameter(torch.randn(width, embed_dim))

    def forward(self, images):
        x = self.conv1(images).flatten(2).transpose(1, 2)  # (B, grid², w)
        cls = self.class_embedding.reshape(-1, x.shape[-1]).expand(x.shape[0], -1, -1)
        x = self.ln_pre(torch.cat([cls, x], dim=1) + self.positional_embedding)
        x = self.transformer(x.permute(1, 0, 2)).permute(1, 0, 2)  # attention in (L, B, w)
        return self.ln_post(x[:, : self.tokens]) @ self.proj  # (B, m, embed_dim)


class MtobCLIP(nn.Module):
    """The authors' release: m class tokens, post-norm BERT-style text encoder."""

    def __init__(self, tokens=4, embed_dim=8, vocab=64, context=12, image_size=32, patch=8, vision_width=128,
                 vision_layers=2, vision_heads=2, text_width=64, text_layers=2, text_heads=2, cls_id=2):
        super().__init__()
        self.tokens, self.cls_id = tokens, cls_id
        self.visual = VisionTransformer(image_size, patch, vision_width, vision_layers, vision_heads, embed_dim,
                                        tokens, nn.GELU)
        self.token_embedding = nn.Embedding(vocab, text_width)
        self.positional_embedding = nn.Parameter(torch.randn(context + tokens - 1, text_width))
        self.ln_embedding = nn.LayerNorm(text_width)
        layer = nn.TransformerEncoderLayer(text_width, text_heads, 4 * text_width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=False)
        self.transformer = nn.Module()
        self.transformer.encoder = nn.TransformerEncoder(layer, text_layers, enable_nested_tensor=False)
        self.ln_final = nn.LayerNorm(text_width)
        self.text_projection = nn.Parameter(torch.randn(text_width, embed_dim))
        self.logit_scale = nn.Parameter(torch.tensor(2.659))
        randomize(self)

    def encode_text(self, ids, mask):
        cls = torch.full((ids.shape[0], self.tokens - 1), self.cls_id)
        ids, mask = torch.cat([cls, ids], 1), torch.cat([torch.ones_like(cls, dtype=torch.bool), mask], 1)
        x = self.ln_embedding(self.token_embedding(ids) + self.positional_embedding[: ids.shape[1]])
        x = self.transformer.encoder(x, src_key_padding_mask=~mask)
        return self.ln_final(x[:, : self.tokens]) @ self.text_projection  # (B, m, n)

    def similarity(self, u, v):
        """Σ_k cos(u_k, v_k): each token normalised; logit_scale not applied (as released)."""
        return torch.einsum("imn,jmn->ij", F.normalize(u, dim=-1), F.normalize(v, dim=-1))


class OpenAICLIP(nn.Module):
    """OpenAI's CLIP: one class token, QuickGELU, causal text tower pooled at argmax(ids)."""

    def __init__(self, embed_dim=16, vocab=600, context=12, image_size=32, patch=8, vision_width=128,
                 vision_layers=2, text_width=64, text_layers=2, activation=QuickGELU):
        super().__init__()
        self.visual = VisionTransformer(image_size, patch, vision_width, vision_layers, vision_width // 64,
                                        embed_dim, 1, activation, openai_shape=True)
        causal = torch.full((context, context), float("-inf")).triu(1)
        self.transformer = Resblocks(text_width, text_layers, text_width // 64, activation, causal)
        self.token_embedding = nn.Embedding(vocab, text_width)
        self.positional_embedding = nn.Parameter(torch.randn(context, text_width))
        self.ln_final = nn.LayerNorm(text_width)
        self.text_projection = nn.Parameter(torch.randn(text_width, embed_dim))
        self.logit_scale = nn.Parameter(torch.tensor(4.6052))
        randomize(self)

    def encode_image(self, images):
        return self.visual(images)[:, 0]  # (B, embed_dim)

    def encode_text(self, ids):
        x = self.token_embedding(ids) + self.positional_embedding
        x = self.transformer(x.permute(1, 0, 2)).permute(1, 0, 2)
        x = self.ln_final(x)
        return x[torch.arange(x.shape[0]), ids.argmax(dim=-1)] @ self.text_projection  # (B, embed_dim)

    def logits(self, images, ids):
        u = F.normalize(self.encode_image(images), dim=-1)
        v = F.normalize(self.encode_text(ids), dim=-1)
        return self.logit_scale.exp() * u @ v.T


def randomize(module: nn.Module, std: float = 0.2) -> None:
    """Every parameter random (LayerNorm weights around 1), so no key can be mapped wrongly unseen."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if name == "logit_scale":
                continue
            noise = torch.randn(parameter.shape, generator=generator) * std
            is_norm_weight = parameter.dim() == 1 and name.endswith("weight") and ("ln" in name or "norm" in name)
            parameter.copy_(1.0 + noise if is_norm_weight else noise)
