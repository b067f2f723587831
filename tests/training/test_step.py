"""The training step: exact gradient accumulation, the loss it computes, mixed precision."""
import copy

import pytest
import torch

from topoclip.config import load_config
from topoclip.core.losses import get_loss
from topoclip.model.clip import CLIP
from topoclip.preprocess.tokenizer import TextBatch
from topoclip.run.training.step import autocast_context, forward_backward

from _tolerance import assert_fp32_close, model_roundings

BATCH = 8


def tiny(overrides=()):
    return CLIP(load_config("tiny", list(overrides)).model)


def random_batch(model, batch=BATCH):
    config = model.config
    size = config.vision.image_size
    images = torch.randn(batch, 3, size, size)
    length = config.text.context_length
    ids = torch.randint(5, config.text.vocab_size, (batch, length))
    ids[:, 0] = config.text.cls_token_id
    lengths = torch.randint(3, length + 1, (batch, 1))
    mask = torch.arange(length)[None] < lengths  # (B, L) True on real tokens
    return images, TextBatch(ids.masked_fill(~mask, 0), mask)


def gradients(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


LOSS_SETUPS = {
    "infonce": [],
    "sigmoid": ["model.temperature.bias_init=-10", "train.loss=sigmoid"],
    "infonce-geodesic": ["model.topology=ps-geodesic"],  # the chunked + checkpointed similarity
    # MERU's loss: the hyperbolic distance (chunked for the product) and the entailment term of the pairs
    "infonce-lorentz": ["model.topology=lorentz", "train.entailment_weight=0.2"],
    "infonce-lorentzproduct": ["model.topology=lorentz-product", "model.class_tokens=2", "train.entailment_weight=0.2"],
}


def roundings(model, batch=BATCH):
    return model_roundings(model.config, batch)


@pytest.mark.parametrize("setup", sorted(LOSS_SETUPS))
def test_accumulated_gradients_equal_the_full_batch_gradients(setup):
    # Against the exact answer (the full batch in float64), the fp32 accumulated step is within the fp32
    # bound of any summation order (tests/_tolerance.py); in float64 the two are equal to float64's.
    loss_name = setup.split("-")[0]
    full = tiny(LOSS_SETUPS[setup]).double()
    accumulated, accumulated32 = copy.deepcopy(full), copy.deepcopy(full).float()
    images, text = random_batch(full)
    images = images.double()

    weight = load_config("tiny", LOSS_SETUPS[setup]).train.entailment_weight
    full_loss = forward_backward(full, images, text, loss_name, entailment_weight=weight)
    accumulated_loss = forward_backward(accumulated, images, text, loss_name, accumulation_steps=4,
                                        entailment_weight=weight)
    accumulated32_loss = forward_backward(accumulated32, images.float(), text, loss_name, accumulation_steps=4,
                                          entailment_weight=weight)

    n = roundings(full)
    assert_fp32_close(torch.tensor(accumulated32_loss), torch.tensor(full_loss, dtype=torch.float64), n, "loss")
    assert accumulated_loss == pytest.approx(full_loss, rel=n * 2.0**-53)
    expected, got, got32 = gradients(full), gradients(accumulated), gradients(accumulated32)
    assert "temperature.t" in got and (loss_name != "sigmoid" or "temperature.bias" in got)
    assert ("curvature.log_c" in got) == ("lorentz" in setup)  # c learns (its gradient compared below)
    for name, grad in expected.items():
        assert grad.abs().max() > 0, f"{name}: zero gradient, the comparison would be vacuous"
        assert_fp32_close(got32[name], grad, n, name)
        assert (got[name] - grad).abs().max() <= n * 2.0**-53 * grad.abs().max(), name  # the float64 γ_n


def test_the_step_computes_the_loss_of_the_whole_batch():
    # k = 1 is the textbook step: the loss of model.similarity on the batch, and its gradient. Both
    # sides run the same operations in the same order, so they agree exactly.
    model = tiny()
    reference = copy.deepcopy(model)
    images, text = random_batch(model)
    value = forward_backward(model, images, text, "infonce")

    out = reference(images, text)
    s = reference.similarity(out.image_embeds, out.text_embeds)  # (B, B)
    loss = get_loss("infonce")(s, s.T, out.scale)
    loss.backward()
    assert value == loss.item()
    torch.testing.assert_close(model.temperature.t.grad, reference.temperature.t.grad, atol=0, rtol=0)


def test_temperature_gradient_is_counted_once_not_per_micro_batch():
    model = tiny().double()
    images, text = random_batch(model)
    forward_backward(model, images.double(), text, "infonce")
    once = model.temperature.t.grad.clone()
    model.zero_grad()
    forward_backward(model, images.double(), text, "infonce", accumulation_steps=8)
    assert once.abs() > 0
    # Counted 8 times it would be 8x as large; in float64 the orders differ by the float64 γ_n only.
    assert model.temperature.t.grad.item() == pytest.approx(once.item(), rel=roundings(model) * 2.0**-53)


@pytest.mark.parametrize("steps", [0, 3])
def test_accumulation_steps_must_divide_the_batch(steps):
    model = tiny()
    images, text = random_batch(model)
    with pytest.raises(ValueError, match="accumulation_steps"):
        forward_backward(model, images, text, accumulation_steps=steps)


def test_fp16_without_a_scaler_is_refused():
    model = tiny()
    images, text = random_batch(model)
    with pytest.raises(ValueError, match="GradScaler"):
        forward_backward(model, images, text, precision="fp16")


def test_autocast_context():
    with autocast_context("fp32", "cpu"):
        assert not torch.is_autocast_enabled("cpu")
    with autocast_context("bf16", "cpu"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="precision"):
        autocast_context("fp8", "cpu")


def _cpu_fp16_scaler():
    try:
        scaler = torch.amp.GradScaler("cpu")
        with torch.autocast("cpu", dtype=torch.float16):
            torch.ones(2, 2) @ torch.ones(2, 2)
    except (RuntimeError, ValueError, TypeError) as error:
        pytest.skip(f"this torch build has no CPU fp16 autocast / GradScaler: {error}")
    return scaler


def _flat(grads):
    return torch.cat([g.flatten().float() for g in grads.values()])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_mixed_precision_at_tau_100_is_finite_and_close_to_fp32(precision, accumulation_steps):
    torch.set_num_threads(1)
    reference = tiny(["model.temperature.init=4.6052"])  # τ = 100, the clamp
    model = copy.deepcopy(reference)
    images, text = random_batch(reference)
    reference_loss = forward_backward(reference, images, text, "infonce")
    expected = _flat(gradients(reference))

    scaler = _cpu_fp16_scaler() if precision == "fp16" else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    # A GradScaler starts at 2^16; with τ = 100 the scaled fp16 gradients may overflow, and the
    # scaler's answer is to skip the step and halve the scale. Follow it for a few halvings.
    for _ in range(12):
        optimizer.zero_grad(set_to_none=False)
        loss = forward_backward(model, images, text, "infonce", accumulation_steps=accumulation_steps,
                                precision=precision, scaler=scaler)
        assert torch.isfinite(torch.tensor(loss))
        if scaler is None:
            break
        scaler.unscale_(optimizer)
        if all(torch.isfinite(p.grad).all() for p in model.parameters()):
            break
        scaler.step(optimizer)  # skipped (inf found); update() halves the scale
        scaler.update()
    got = _flat(gradients(model))
    assert torch.isfinite(got).all()
    # bf16 (u = 2⁻⁸) / fp16 (u = 2⁻¹¹) matmuls accumulate in fp32 but round inputs and outputs: a few
    # roundings of u per layer, ≈ 10·2⁻⁸ ≈ 4 % on the loss at worst; a wrong (unscaled or overflowed)
    # step is off by far more. The direction check below is the same argument on the gradient.
    assert loss == pytest.approx(reference_loss, rel=0.05)
    cosine = torch.nn.functional.cosine_similarity(got, expected, dim=0)
    assert cosine > 0.95, f"{precision} gradient direction differs from fp32: cos = {cosine:.3f}"
