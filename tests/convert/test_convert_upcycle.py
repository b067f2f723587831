"""Upcycling a single-token model to Multi(n, m) and fine-tuning it with `topoclip train --init-from`."""
import json

import pytest
import torch

from topoclip.io.checkpoint import load_checkpoint, save_checkpoint, step_checkpoints
from topoclip.cli import main
from topoclip.config import ConfigError, load_config
from topoclip.io.convert.upcycle import shared_basis, upcycle
from topoclip.model.clip import CLIP
from topoclip.preprocess.tokenizer import TextBatch
from topoclip.run.training.init_from import check_initial_checkpoint, starting_config
from topoclip.run.training.tokenizer_setup import build_tokenizer, fit_to_trained_tokenizer

from _tolerance import TINY, fp32_pair, model_roundings

# A fast run (as in test_train.py): small scenes, no workers, a small evaluation.
SMALL = ["train.num_workers=0", "train.log_every=1", "evaluate.size=48", 'evaluate.template_modes=["distance"]',
         "data.scenes.train_size=2048", "data.scenes.val_size=64", "data.scenes.test_size=64"]
# tiny towers (2 layers, width 64, 32 tokens), forward only: two fp32 computations of one similarity
# in [−1, 1] are within 2·γ_n (tests/_tolerance.py) on any CPU.
TINY_FORWARD = model_roundings(TINY, batch=1)
TINY_PAIR = fp32_pair(TINY_FORWARD)
SINGLE = ["model.class_tokens=1", "model.embed_dim=64", "model.topology=sphere"]


def text_batch(config, batch=4):
    ids = torch.randint(5, config.text.vocab_size - 1, (batch, config.text.context_length))
    ids[:, 0] = config.text.cls_token_id
    lengths = torch.randint(3, 9, (batch, 1))
    lengths[0] = config.text.context_length  # one text fills the context: its end-of-text token is the last id
    mask = torch.arange(config.text.context_length)[None] < lengths
    ids = ids.masked_fill(~mask, 0)
    ids[torch.arange(batch), lengths[:, 0] - 1] = config.text.vocab_size - 1  # end of text: the largest id
    return TextBatch(ids, mask)


def embeddings(model, images, text):
    with torch.no_grad():
        return model.encode_image(images), model.encode_text(text)


@pytest.fixture(scope="module")
def single_token_checkpoint(tmp_path_factory):
    """A tiny single-token sphere model (random weights) with a vocabulary of the built-in scenes."""
    config = load_config("tiny", SMALL + SINGLE)
    tokenizer = build_tokenizer(config)
    config = fit_to_trained_tokenizer(config, tokenizer)  # as the trainer does (a loaded Config is frozen)
    torch.manual_seed(0)
    return save_checkpoint(tmp_path_factory.mktemp("single") / "ckpt", CLIP(config.model), config, tokenizer)


@pytest.mark.slow
def test_one_copy_reproduces_the_source_exactly(single_token_checkpoint, tmp_path):
    assert main(["convert", str(single_token_checkpoint), str(tmp_path / "same"), "--class-tokens", "1"]) == 0
    source, _, config = load_checkpoint(single_token_checkpoint)
    copy, _, copy_config = load_checkpoint(tmp_path / "same")
    images, text = torch.randn(3, 3, 32, 32), text_batch(config.model)
    for ours, theirs in zip(embeddings(copy, images, text), embeddings(source, images, text)):
        assert torch.equal(ours, theirs)
    assert copy_config.model == config.model


def test_upcycled_shapes_temperature_and_tokens(single_token_checkpoint):
    source, _, config = load_checkpoint(single_token_checkpoint)
    model, multi = upcycle(source, config, class_tokens=4, embed_dim=16, noise=0.05)
    assert (multi.model.class_tokens, multi.model.embed_dim, multi.model.topology) == (4, 16, "ps-inner")
    assert model.visual.class_embedding.shape == (4, 64)
    assert model.text.positional_embedding.shape[0] == config.model.text.context_length + 3
    # τ / m keeps the starting logits (s is now ~m × the source's cosine); the clamp scales the same way.
    assert float(model.temperature.scale.detach()) == pytest.approx(float(source.temperature.scale.detach()) / 4, rel=1e-5)
    assert multi.model.temperature.max_scale == pytest.approx(25.0)
    # Copy 1 is the source's token; the others differ from it by a little noise.
    base = source.visual.class_embedding[0]
    assert torch.equal(model.visual.class_embedding[0], base)
    spread = (model.visual.class_embedding[1:] - base).norm(dim=-1) / base.norm()
    assert bool((spread > 0.01).all() and (spread < 0.2).all())


def test_truncated_svd_keeps_a_rank_n_space_exactly(single_token_checkpoint):
    # When both projections only use n of their d output directions, reducing d -> n loses nothing:
    # the upcycled m = 1 model scores every pair as the source does.
    source, _, config = load_checkpoint(single_token_checkpoint)
    rotation = torch.linalg.qr(torch.randn(64, 64))[0][:, :16]  # (d, n) orthonormal
    with torch.no_grad():
        for projection in (source.visual.proj, source.text.text_projection):
            projection.copy_(projection @ rotation @ rotation.T)  # rank 16
    model, _ = upcycle(source, config, class_tokens=1, embed_dim=16)
    images, text = torch.randn(4, 3, 32, 32), text_batch(config.model, 5)
    expected = source.similarity(*embeddings(source, images, text))
    torch.testing.assert_close(model.similarity(*embeddings(model, images, text)), expected, **TINY_PAIR)
    basis = shared_basis([source.visual.proj.detach(), source.text.text_projection.detach()], 16)
    # float64 orthonormalisation of 16 columns of length ≤ 128: γ_(16·128) in float64 ≈ 2e-13
    torch.testing.assert_close(basis.T @ basis, torch.eye(16, dtype=basis.dtype), atol=16 * 128 * 2.0**-53, rtol=0)


def test_openai_layout_keeps_its_first_end_of_text_token():
    # Causal text tower pooled at the end-of-text token: the m − 1 extra copies come after it, so the
    # first output is the source's, exactly as OpenAI computed it.
    config = load_config("tiny", SINGLE + ["model.text.attention=causal", "model.text.pooling=end_of_text",
                                           "model.text.norm_first=true", "model.text.embedding_norm=false",
                                           "model.vision.activation=quick_gelu", "model.text.activation=quick_gelu"])
    source = CLIP(config.model)
    model, _ = upcycle(source, config, class_tokens=3, noise=0.05)
    text = text_batch(config.model)
    with torch.no_grad():
        theirs, ours = source.text(text.input_ids, text.attention_mask), model.text(text.input_ids, text.attention_mask)
    assert ours.shape == (4, 3, 64)
    torch.testing.assert_close(ours[:, 0], theirs[:, 0], **fp32_pair(TINY_FORWARD, float(theirs.abs().max())))
    assert float((ours[:, 1] - ours[:, 0]).abs().max()) > 1e-3  # the copies sit at other positions


def test_refusals(single_token_checkpoint):
    source, _, config = load_checkpoint(single_token_checkpoint)
    with pytest.raises(ConfigError, match="reduced"):
        upcycle(source, config, class_tokens=2, embed_dim=128)
    multi, multi_config = upcycle(source, config, class_tokens=2, embed_dim=32)
    with pytest.raises(ConfigError, match="single-token"):
        upcycle(multi, multi_config, class_tokens=4)


@pytest.mark.slow
def test_upcycled_model_fine_tunes_with_init_from(single_token_checkpoint, tmp_path, capsys):
    upcycled = tmp_path / "multi"
    assert main(["convert", str(single_token_checkpoint), str(upcycled), "--class-tokens", "4", "--embed-dim", "16"]) == 0
    run = tmp_path / "run"
    assert main(["train", "--init-from", str(upcycled), "--out", str(run), "--quiet", "--set", "train.steps=3"]) == 0
    saved = json.loads((run / "config.json").read_text())
    assert saved["train"]["init_from"] == str(upcycled) and saved["model"]["class_tokens"] == 4
    assert (run / "tokenizer.json").read_text() == (single_token_checkpoint / "tokenizer.json").read_text()
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(losses) == 3 and all(map(torch.isfinite, torch.tensor(losses)))
    start, _, _ = load_checkpoint(upcycled)
    trained, _, _ = load_checkpoint(step_checkpoints(run / "checkpoints")[-1])
    assert not torch.equal(trained.visual.class_embedding, start.visual.class_embedding)  # it trained
    # With the preset named instead, the run's model must match the checkpoint's: tiny's does.
    check_initial_checkpoint(starting_config(upcycled, "tiny", SMALL))


def test_init_from_refuses_a_different_model(single_token_checkpoint, tmp_path, capsys):
    # A run configured with QuickGELU against a GELU checkpoint would change every output: refused.
    assert main(["train", "--init-from", str(single_token_checkpoint), "--out", str(tmp_path / "a"),
                 "--set", "model.vision.activation=quick_gelu"]) == 2
    error = capsys.readouterr().err
    assert "model.vision.activation is gelu but this run's is quick_gelu" in error and error.count("\n") == 1
    # A different number of class tokens: upcycle first.
    assert main(["train", "--preset", "tiny", "--init-from", str(single_token_checkpoint), "--out", str(tmp_path / "b")]) == 2
    assert "upcycle it first" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
