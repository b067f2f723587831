"""Where the text tower's m output tokens sit in the sequence, and which positions it reads.

Two layouts, chosen by ``model.text.pooling``:

- ``"class_tokens"`` (BERT style, the paper's): the [CLS] id repeated m times at the start,
  ``[CLS]×m w1 … [SEP] [PAD]…``; the outputs are positions 0 … m − 1. Nothing else is read, so the
  last block computes only those rows.
- ``"end_of_text"`` (OpenAI CLIP): the end-of-text token repeated m times where it stands,
  ``<sot> w1 … <eot>×m [PAD]…``; the outputs are those m positions. The end-of-text token is the
  first token of id ``model.text.end_token_id`` (OpenCLIP's ``pool_type="eos"``; [SEP] in a WordPiece
  vocabulary) or, when that is None, the largest id of the sequence (OpenAI's tokenizer numbers it
  last; their code pools at ``argmax(ids)``). In a causal tower the first copy sees exactly what
  OpenAI's pooled token sees, whatever m is, so a single-token OpenAI model upcycled to m tokens
  keeps its first output.

- ``"last"`` (SigLIP): the text padded to the full context is read at its last position, whatever stands there
  (the end token or padding); the padding is attended (SigLIP was trained so), so the tower takes the whole padded
  context and no key mask. m tokens: the last id repeated m − 1 more times at the end; the outputs are the last m.

All lengthen a (B, L) sequence to L + m − 1: the positional table has context + m − 1 rows.
Neither branches on values, so both trace (ONNX export). Each is built from (m, the TextConfig).
"""
from __future__ import annotations

import torch
from torch import nn


class ClassTokenPooling(nn.Module):
    """[CLS]×m at the start; reads positions 0 … m − 1."""

    attends_padding = False  # padding is masked as a key, and may be trimmed off

    def __init__(self, class_tokens: int, config):
        super().__init__()
        self.class_tokens = class_tokens
        self.cls_token_id = config.cls_token_id
        self.output_tokens = class_tokens  # the last block may compute only these first rows

    def insert(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, mask (B, L) starting with one [CLS] -> (B, L + m − 1) with m − 1 more [CLS] in front."""
        extra = self.class_tokens - 1
        if not extra:
            return input_ids, attention_mask
        cls = input_ids.new_full((input_ids.shape[0], extra), self.cls_token_id)
        return torch.cat([cls, input_ids], dim=1), torch.cat([attention_mask.new_ones(cls.shape), attention_mask], dim=1)

    def select(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, ≥ m, w) -> (B, m, w): the class tokens."""
        return x[:, : self.class_tokens]


class EndOfTextPooling(nn.Module):
    """The end-of-text token (config.end_token_id, else the largest id) ×m where it stands; reads those m positions."""

    attends_padding = False

    def __init__(self, class_tokens: int, config):
        super().__init__()
        self.class_tokens = class_tokens
        self.end_token_id = config.end_token_id
        self.output_tokens = 0  # the rows read differ per text: every row is computed

    def end(self, input_ids: torch.Tensor) -> torch.Tensor:
        """ids (B, L) -> (B, 1) position of the end-of-text token: the first of equal maxima (argmax's rule)."""
        if self.end_token_id is None:
            return input_ids.argmax(dim=1, keepdim=True)
        return (input_ids == self.end_token_id).int().argmax(dim=1, keepdim=True)

    def insert(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, mask (B, L) -> (B, L + m − 1) with m − 1 more end-of-text tokens right after the first.

        They overwrite padding (which follows the end of text) or extend the sequence.
        """
        extra = self.class_tokens - 1
        if not extra:
            return input_ids, attention_mask
        batch = input_ids.shape[0]
        end = self.end(input_ids)  # (B, 1)
        after = end + torch.arange(1, extra + 1, device=input_ids.device)  # (B, m − 1)
        ids = torch.cat([input_ids, input_ids.new_zeros(batch, extra)], dim=1)
        mask = torch.cat([attention_mask, attention_mask.new_zeros(batch, extra)], dim=1)
        ids = ids.scatter(1, after, input_ids.gather(1, end).expand(-1, extra))
        mask = mask.scatter(1, after, torch.ones_like(after, dtype=mask.dtype))
        return ids, mask

    def select(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, L, w), ids (B, L) after `insert` -> (B, m, w): the m end-of-text positions."""
        start = self.end(input_ids)  # (B, 1): the original end-of-text token, the first of its copies
        rows = start + torch.arange(self.class_tokens, device=x.device)  # (B, m)
        return x.gather(1, rows[..., None].expand(-1, -1, x.shape[-1]))


class LastPooling(nn.Module):
    """The last id ×m at the end of the padded text; reads the last m positions (SigLIP's, for m = 1)."""

    attends_padding = True  # the whole padded context is read, padding unmasked

    def __init__(self, class_tokens: int, config):
        super().__init__()
        self.class_tokens = class_tokens
        self.output_tokens = 0

    def insert(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, mask (B, L) -> (B, L + m − 1): the last id m − 1 more times."""
        extra = self.class_tokens - 1
        if not extra:
            return input_ids, attention_mask
        return (torch.cat([input_ids, input_ids[:, -1:].expand(-1, extra)], dim=1),
                torch.cat([attention_mask, attention_mask[:, -1:].expand(-1, extra)], dim=1))

    def select(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, L, w) -> (B, m, w): the last m positions."""
        return x[:, x.shape[1] - self.class_tokens:]


POOLINGS = {"class_tokens": ClassTokenPooling, "end_of_text": EndOfTextPooling, "last": LastPooling}


def end_of_text_id(config, id_bound: int):
    """The id end_of_text pooling reads in texts of ids < `id_bound` (None for class_tokens pooling): what must be
    the tokenizer's end token."""
    if config.pooling != "end_of_text":
        return None
    return config.end_token_id if config.end_token_id is not None else id_bound - 1
