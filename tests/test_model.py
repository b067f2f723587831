"""Every preset builds; tiny ones run forward + backward; shapes, parameter counts, the text tokens."""
import pytest
import torch

import topoclip
from topoclip.config import load_config
from topoclip.core.geometry import TOPOLOGIES
from topoclip.core.losses import infonce_loss
from topoclip.model.clip import CLIP
from topoclip.preprocess.tokenizer import TextBatch

from _tolerance import TINY, fp32_pair, model_roundings

PRESETS = topoclip.presets()


def text_batch(config, batch=4, length=7):
    ids = torch.randint(5, config.text.vocab_size, (batch, config.text.context_length))
    ids[:, 0] = config.text.cls_token_id
    mask = torch.arange(config.text.context_length)[None].expand(batch, -1) < torch.randint(2, length + 1, (batch, 1))
    return TextBatch(ids.masked_fill(~mask, 0), mask)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_builds(name):
    config = load_config(name)
    with torch.device("meta"):  # shapes and parameter counts without allocating ViT-B weights
        model = CLIP(config.model)
    m, n = model.embedding_shape
    assert m * n == config.model.class_tokens * config.model.embed_dim
    assert model.visual.class_embedding.shape == (config.model.class_tokens, config.model.vision.width)
    assert model.text.positional_embedding.shape[0] == config.model.text.context_length + config.model.class_tokens - 1


@pytest.mark.parametrize("name, expected", [("sphere-vit-s16", 22e6), ("sphere-vit-b16", 86e6)])
def test_paper_image_towers_have_the_paper_sizes(name, expected):
    with torch.device("meta"):
        model = topoclip.build_model(name)
    count = sum(p.numel() for p in model.visual.parameters())
    assert abs(count - expected) / expected < 0.02


SHAPES = [(topology, tokens, spheres) for topology in sorted(TOPOLOGIES) for tokens, spheres in [(1, 0), (1, 4), (4, 0)]
          if topology.startswith("ps-") or not spheres]  # `spheres` applies to product spheres only


@pytest.mark.parametrize("topology, tokens, spheres", SHAPES)
def test_tiny_forward_backward(topology, tokens, spheres):
    config = load_config("tiny", [f"model.topology={topology}", f"model.class_tokens={tokens}",
                                  f"model.spheres={spheres}", "model.embed_dim=16"]).model
    model = CLIP(config)
    images = torch.randn(4, 3, 32, 32)
    out = model(images, text_batch(config))
    m, n = model.embedding_shape
    assert out.image_embeds.shape == out.text_embeds.shape == (4, m, n)
    assert out.bias is None and out.scale.item() == pytest.approx(1 / 0.07, rel=1e-3)
    s = model.similarity(out.image_embeds, out.text_embeds)
    loss = infonce_loss(s, s.T, out.scale)
    loss.backward()
    assert torch.isfinite(loss)
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name


def test_single_token_product_sphere_reshapes_one_vector():
    model = CLIP(load_config("tiny", ["model.class_tokens=1", "model.embed_dim=64", "model.spheres=8"]).model)
    out = model.encode_image(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 8, 8)
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(2, 8), **fp32_pair(8 + 8))  # normalise, then norm: 8 terms each
    raw = model.visual(torch.randn(2, 3, 32, 32))  # (2, 1, 64) → 8 rows of 8
    assert raw.shape == (2, 1, 64)


def test_text_class_tokens_differ_only_by_position():
    config = load_config("tiny").model
    model = CLIP(config).eval()
    batch = text_batch(config)
    with torch.no_grad():
        out = model.text(batch.input_ids, batch.attention_mask)  # (B, m, e)
    assert out.shape == (4, config.class_tokens, config.embed_dim)
    assert not torch.allclose(out[:, 0], out[:, 1])  # positions make the tokens differ
    with torch.no_grad():
        model.text.positional_embedding.zero_()
        same = model.text(batch.input_ids, batch.attention_mask)
    # without positions the m [CLS] tokens coincide (up to where in a kernel each row is computed)
    torch.testing.assert_close(same[:, 0], same[:, 1], **fp32_pair(model_roundings(TINY, 4), float(same.abs().max())))


def test_padding_does_not_change_the_text_embedding():
    config = load_config("tiny").model
    model = CLIP(config).eval()
    batch = text_batch(config)
    with torch.no_grad():
        full = model.encode_text(batch)
        garbage = batch.input_ids.masked_fill(~batch.attention_mask, 17)  # pads replaced by any token
        trimmed = model.encode_text(TextBatch(garbage, batch.attention_mask))
        alone = model.encode_text(batch[1:2])
    torch.testing.assert_close(full, trimmed, atol=0, rtol=0)  # masked positions are never read: exact
    # A batch of one may take other BLAS kernels than a batch of four: two fp32 computations of
    # unit-norm rows through the tiny tower, within 2·γ_n of each other on any CPU.
    torch.testing.assert_close(full[1:2], alone, **fp32_pair(model_roundings(TINY, 1)))


def test_images_of_the_wrong_size_are_refused():
    model = topoclip.build_model("tiny")
    with pytest.raises(ValueError, match="32×32"):
        model.encode_image(torch.randn(1, 3, 64, 64))


def test_gradient_checkpointing_gives_the_same_gradients():
    config = load_config("tiny").model
    grads = []
    for enabled in (False, True):
        torch.manual_seed(0)
        model = CLIP(config)
        model.set_gradient_checkpointing(enabled)
        torch.manual_seed(1)
        out = model(torch.randn(3, 3, 32, 32), text_batch(config, 3))
        s = model.similarity(out.image_embeds, out.text_embeds)
        infonce_loss(s, s.T, out.scale).backward()
        grads.append(model.visual.conv1.weight.grad.clone())
    # the same operations recomputed: within 2·γ_n of each other normwise, whatever the kernels
    torch.testing.assert_close(*grads, **fp32_pair(model_roundings(TINY, 3), float(grads[0].abs().max())))


def test_temperature_clamp_and_fixed_mode():
    model = CLIP(load_config("tiny", ["model.temperature.max_scale=50"]).model)
    with torch.no_grad():
        model.temperature.t.fill_(10.0)
    model.temperature.clamp_()
    assert model.temperature.scale.item() == pytest.approx(50.0, rel=1e-5)
    fixed = CLIP(load_config("tiny", ["model.temperature.learnable=false", "model.temperature.init=0"]).model)
    assert "temperature.t" not in dict(fixed.named_parameters())
    assert fixed.temperature.scale.item() == 1.0
    siglip = CLIP(load_config("tiny", ["model.temperature.bias_init=-10", "model.temperature.init=2.302585", "train.loss=sigmoid"]).model)
    assert siglip(torch.randn(1, 3, 32, 32)).bias.item() == -10.0


@pytest.mark.slow
def test_library_imports_without_the_trainer():
    import subprocess
    import sys

    code = ("import sys, topoclip; topoclip.build_model('tiny'); "
            "assert 'topoclip.run.training.trainer' not in sys.modules, 'the trainer was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
