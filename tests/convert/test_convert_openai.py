"""Importing OpenAI / OpenCLIP ViT checkpoints: a model in OpenAI's layout from torch primitives
(QuickGELU, causal text tower pooled at argmax(ids)), its BPE tokenizer from a tiny merges file,
the same numbers after `topoclip convert --from openai`; a GELU/QuickGELU mismatch is refused."""
import gzip
import json
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

import topoclip
from _conversion_references import OpenAICLIP
from topoclip.cli import main
from topoclip.config import ConfigError
from topoclip.io.convert.openai import bpe_tokenizer, bytes_to_unicode, import_openai

from _tolerance import fp32_pair, network_roundings

# Merges in rank order (OpenAI applies the best-ranked pair first, wherever it is in the word).
MERGES = ["t h", "th e</w>", "a t</w>", "c a", "p h", "ph o", "pho t", "phot o</w>", "o f</w>", "d o", "do g</w>",
          "r e", "re d</w>", "c at</w>", "4 2</w>", "s n", "a k", "ak e</w>"]
TEXTS = ["a photo of the cat", "The RED dog!!", "it's 42 cats", "café   snake_case", "do dogs"]
# Our tower and the reference are two fp32 computations of the same unit-norm embeddings through
# ≤ 2 layers of width ≤ 128 and ≤ 20 tokens: within 2·γ_n of each other (tests/_tolerance.py), ≈ 2e-4,
# on any CPU. A wrong weight mapping errs by more than 1e-3 (test_wrong_heads_change_the_outputs).
TOLERANCE = fp32_pair(network_roundings(layers=2, width=128, context=20, batch=1))


def write_merges(path, merges=MERGES):
    path.write_bytes(gzip.compress(("#version: 0.2\n" + "\n".join(merges) + "\n").encode()))
    return path


class OpenAIReferenceTokenizer:
    """OpenAI's SimpleTokenizer algorithm (bpe() as published), for ASCII/Latin test texts."""

    PATTERN = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d|[^\W\d_]+|\d|(?:[^\s\w]|_)+", re.IGNORECASE)

    def __init__(self, merges):
        self.byte_encoder = bytes_to_unicode()
        pairs = [tuple(m.split()) for m in merges]
        vocab = list(self.byte_encoder.values())
        vocab = vocab + [v + "</w>" for v in vocab] + ["".join(p) for p in pairs] + ["<|startoftext|>", "<|endoftext|>"]
        self.encoder = {token: index for index, token in enumerate(vocab)}
        self.ranks = {pair: rank for rank, pair in enumerate(pairs)}

    def bpe(self, token):
        word = tuple(token[:-1]) + (token[-1] + "</w>",)
        while len(word) > 1:
            pairs = {(word[i], word[i + 1]) for i in range(len(word) - 1)}
            bigram = min(pairs, key=lambda pair: self.ranks.get(pair, float("inf")))
            if bigram not in self.ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == bigram:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
        return word

    def encode(self, text, context):
        text = re.sub(r"\s+", " ", text).strip().lower()
        ids = [self.encoder["<|startoftext|>"]]
        for token in self.PATTERN.findall(text):
            token = "".join(self.byte_encoder[b] for b in token.encode("utf-8"))
            ids += [self.encoder[piece] for piece in self.bpe(token)]
        ids = ids[: context - 1] + [self.encoder["<|endoftext|>"]]
        return ids + [0] * (context - len(ids))


def test_bpe_tokenizer_equals_openais_algorithm(tmp_path):
    vocab_size = 512 + len(MERGES) + 2
    tokenizer = bpe_tokenizer(write_merges(tmp_path / "bpe.txt.gz"), vocab_size, context_length=12)
    reference = OpenAIReferenceTokenizer(MERGES)
    batch = tokenizer(TEXTS + ["a very long caption that does not fit in twelve tokens at all"])
    for row, text in zip(batch.input_ids.tolist(), TEXTS + ["a very long caption that does not fit in twelve tokens at all"]):
        assert row == reference.encode(text, 12), text
    assert (tokenizer.cls_id, tokenizer.sep_id, tokenizer.vocab_size) == (vocab_size - 2, vocab_size - 1, vocab_size)
    # "a t</w>" outranks "c a", so "cat" is c + at</w> and then cat</w>; "ca" never forms.
    assert tokenizer("cat").input_ids[0, 1:3].tolist() == [reference.encoder["cat</w>"], vocab_size - 1]
    assert batch.attention_mask[0].sum() == 7  # <sot> a photo of the cat <eot>
    assert tokenizer.decode(batch.input_ids[0]) == "a photo of the cat"
    saved = topoclip.Tokenizer.load(tokenizer.save(tmp_path / "tokenizer.json"))
    assert torch.equal(saved(TEXTS).input_ids, tokenizer(TEXTS).input_ids)


def test_a_short_merges_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="needs 100"):
        bpe_tokenizer(write_merges(tmp_path / "bpe.txt.gz"), 512 + 100 + 2)


def reference_model(activation=None):
    from _conversion_references import QuickGELU

    return OpenAICLIP(vocab=512 + len(MERGES) + 2, activation=activation or QuickGELU).eval()


def compare(clip, reference, tokenizer):
    images = torch.randn(3, 3, 32, 32)
    ids = tokenizer(TEXTS).input_ids  # OpenAI's own forward reads the padded ids as they are
    with torch.no_grad():
        u, v = F.normalize(reference.encode_image(images), dim=-1), F.normalize(reference.encode_text(ids), dim=-1)
        logits = reference.logits(images, ids)
    ours_u, ours_v = clip.encode_image(images), clip.encode_text(TEXTS)  # (B, 1, n)
    torch.testing.assert_close(ours_u[:, 0], u, **TOLERANCE)
    torch.testing.assert_close(ours_v[:, 0], v, **TOLERANCE)
    torch.testing.assert_close(clip.model.similarity(ours_u, ours_v), u @ v.T, **TOLERANCE)
    scale = clip.model.temperature.scale.detach()
    # τ ≈ 100 times similarities of the TOLERANCE above
    torch.testing.assert_close(scale * clip.model.similarity(ours_u, ours_v), logits, atol=100 * TOLERANCE["atol"], rtol=0)
    return float((ours_v[:, 0] - v).abs().max())


def test_imported_openai_model_gives_the_original_numbers(tmp_path):
    reference = reference_model()
    source = tmp_path / "ViT-tiny.bin"
    torch.save(reference.state_dict(), source)
    merges = write_merges(tmp_path / "bpe_simple_vocab_16e6.txt.gz")
    assert main(["convert", "--from", "openai", str(source), str(tmp_path / "out"), "--vocab", str(merges)]) == 0
    clip = topoclip.load(tmp_path / "out")
    text = clip.model.config.text
    assert (text.attention, text.pooling, text.activation, text.norm_first, text.embedding_norm) == \
        ("causal", "end_of_text", "quick_gelu", True, False)
    compare(clip, reference, clip.tokenizer)


def test_openclip_activation_comes_from_its_config_file(tmp_path):
    reference = reference_model(nn.GELU)  # an OpenCLIP model trained with GELU (e.g. LAION's ViT-B-16)
    folder = tmp_path / "hub-snapshot"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, folder / "open_clip_model.safetensors")
    # The heads as OpenCLIP writes them (its defaults, 64-wide vision heads and 8 text heads, where left out)
    (folder / "open_clip_config.json").write_text(json.dumps({
        "model_cfg": {"embed_dim": 16, "vision_cfg": {"head_width": 64}, "text_cfg": {"heads": 1}},
        "preprocess_cfg": {"mean": [0.5] * 3, "std": [0.25] * 3}}))
    merges = write_merges(tmp_path / "bpe.txt.gz")
    model, tokenizer, config = import_openai(folder, "openclip", merges)
    assert (config.model.vision.activation, config.model.vision.mean) == ("gelu", (0.5, 0.5, 0.5))
    assert config.model.vision.eval_resize == "shortest"  # OpenCLIP's evaluation pixels (test_transforms.py)
    compare(topoclip.Pretrained(model.eval(), tokenizer, None), reference, tokenizer)
    # Its config says GELU: asking for QuickGELU, or calling it OpenAI's, is refused.
    with pytest.raises(ConfigError, match="does not match"):
        import_openai(folder, "openclip", activation="quick_gelu")
    with pytest.raises(ConfigError, match="use --from openclip"):
        import_openai(folder, "openai")


def test_activation_mismatches_are_refused_not_warned(tmp_path, capsys):
    state = reference_model().state_dict()
    with pytest.raises(ConfigError, match="trained with quick_gelu"):
        import_openai(state, "openai", overrides=["model.vision.activation=gelu"])
    with pytest.raises(ConfigError, match="do not store their activation"):
        import_openai(state, "openclip")  # no open_clip_config.json and no --activation
    source = tmp_path / "openai.pt"
    torch.save(state, source)
    assert main(["convert", "--from", "openai", str(source), str(tmp_path / "out"),
                 "--set", "model.text.activation=gelu"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "quick_gelu" in error
    assert not (tmp_path / "out").exists()


def test_a_causal_text_tower_needs_end_of_text_pooling():
    # Class tokens at the start of a causal tower would see only themselves.
    with pytest.raises(ConfigError, match="pooling=end_of_text"):
        topoclip.load_config("tiny", ["model.text.attention=causal"])
