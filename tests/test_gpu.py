"""CUDA checks (run with `pytest --run-gpu` on a GPU machine; skipped elsewhere)."""
import pytest
import torch

from topoclip.config import load_config
from topoclip.core.geometry import similarity, to_space
from topoclip.model.clip import CLIP
from topoclip.preprocess.tokenizer import TextBatch
from topoclip.run.training.step import forward_backward, process_settings

from _tolerance import TINY, fp32_pair, gamma, model_roundings

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def fp32_products():
    """Each test's fp32 products in fp32: the bounds below are fp32's, and cuDNN runs fp32 convolutions in TF32
    unless told not to (a test that trains asks for TF32 as the trainer does, inside its own process_settings)."""
    with process_settings(0, tf32=False):
        yield


def batch_for(config, batch, device):
    ids = torch.randint(5, config.text.vocab_size, (batch, config.text.context_length), device=device)
    ids[:, 0] = config.text.cls_token_id
    return TextBatch(ids, torch.ones_like(ids, dtype=torch.bool))


TOPOLOGIES = {"default": [], "lorentz": ["model.topology=lorentz"],
              "lorentz-product": ["model.topology=lorentz-product", "model.class_tokens=2"]}


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_cuda_step_is_finite_at_tau_100(precision, topology):
    config = load_config("tiny", ["model.temperature.init=4.6052", *TOPOLOGIES[topology]]).model
    model = CLIP(config).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    images, text = torch.randn(64, 3, 32, 32, device="cuda"), batch_for(config, 64, "cuda")
    keywords = {"entailment_weight": 0.2} if topology != "default" else {}
    if precision != "fp16":
        loss = forward_backward(model, images, text, precision=precision, **keywords)
        assert loss == loss and abs(loss) < 1e4
        for name, parameter in model.named_parameters():
            assert torch.isfinite(parameter.grad).all(), name
        return
    # fp16: the scaler starts at 2^16 and may overflow first; it must settle on a finite step.
    scaler = torch.amp.GradScaler("cuda")
    for _ in range(20):
        optimizer.zero_grad(set_to_none=True)
        loss = forward_backward(model, images, text, precision=precision, scaler=scaler, **keywords)
        assert loss == loss and abs(loss) < 1e4  # the loss itself is fp32
        scaler.unscale_(optimizer)
        finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
        scaler.step(optimizer)
        scaler.update()
        if finite:
            break
    assert finite and all(torch.isfinite(p).all() for p in model.parameters())


def test_cuda_matches_cpu_in_fp32():
    config = load_config("tiny").model
    torch.manual_seed(0)
    model = CLIP(config)
    images = torch.randn(8, 3, 32, 32)
    with torch.no_grad():
        cpu = model.encode_image(images)
        gpu = model.cuda().encode_image(images.cuda()).cpu()
    # Two fp32 computations of unit-norm rows (GPU matmuls may use other blockings): 2·γ_n of the tiny tower
    torch.testing.assert_close(cpu, gpu, **fp32_pair(model_roundings(TINY, 1)))


def test_geodesic_16k_by_16k_in_chunks_fits_memory():
    u = to_space("ps-geodesic", torch.randn(16384, 16, 32, device="cuda"))
    torch.cuda.reset_peak_memory_stats()
    s = similarity("ps-geodesic", u, u)
    peak = torch.cuda.max_memory_allocated()
    full_intermediate = 16384 * 16384 * 16 * 4  # the (b, b, m) fp32 tensor a naive version holds: 16 GiB
    assert s.shape == (16384, 16384) and peak < full_intermediate / 8
    assert torch.isfinite(s).all()


def test_cuda_training_run(tmp_path):
    from topoclip.run.training.trainer import train

    run = train(load_config("tiny", ["train.steps=4", "train.precision=bf16", "train.device=cuda", "evaluate.size=32",
                                     "data.scenes.train_size=512", "data.scenes.test_size=64", "train.num_workers=2"]),
                out_dir=tmp_path / "run", progress=False)
    assert (run / "eval.json").is_file()


def test_compiled_model_matches_eager():
    config = load_config("tiny").model
    torch.manual_seed(0)
    model = CLIP(config).cuda()
    images, text = torch.randn(16, 3, 32, 32, device="cuda"), batch_for(config, 16, "cuda")
    eager = forward_backward(model, images, text)
    eager_grad = model.visual.conv1.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    compiled = forward_backward(torch.compile(model), images, text)
    # Inductor fuses and reorders the same fp32 reductions: both within γ_n of exact, normwise
    n = model_roundings(TINY, 16)
    assert compiled == pytest.approx(eager, abs=2 * gamma(n) * abs(eager))
    torch.testing.assert_close(model.visual.conv1.weight.grad, eager_grad,
                               **fp32_pair(n, float(eager_grad.abs().max())))


def text_of_lengths(config, lengths, device):
    """Random ids with texts of the given real lengths, padded to the context."""
    batch = batch_for(config, len(lengths), device)
    mask = torch.arange(config.text.context_length, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    return TextBatch(batch.input_ids.masked_fill(~mask, 0), mask)


def test_compiled_bf16_step_has_no_graph_break_nor_recompilation_across_lengths():
    from torch._dynamo.testing import CompileCounterWithBackend

    from topoclip.run.training.step import autocast_context

    config = load_config("tiny").model
    model = CLIP(config).cuda()
    images = torch.randn(4, 3, 32, 32, device="cuda")
    with autocast_context("bf16", "cuda"):
        explanation = torch._dynamo.explain(model)(images, text_of_lengths(config, [3, 9, 4, 5], "cuda"))
    assert explanation.graph_break_count == 0
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter)
    for lengths in ([3, 4, 6, 2], [17, 2, 9, 30], [5, 5, 5, 5]):
        loss = forward_backward(compiled, images, text_of_lengths(config, lengths, "cuda"), precision="bf16")
        assert loss == loss
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_fused_optimizer_skips_a_non_finite_step_on_the_device():
    from topoclip.run.training.optim import build_optimizer
    from topoclip.run.training.step import forward_backward_loss, optimizer_step

    config = load_config("tiny")
    model = CLIP(config.model).cuda()
    optimizer = build_optimizer(model, config.train)
    assert optimizer.defaults.get("fused")
    images, text = torch.randn(8, 3, 32, 32, device="cuda"), batch_for(config.model, 8, "cuda")
    forward_backward_loss(model, images, text)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer_step(model, optimizer, None, 1.0, skip=torch.ones((), device="cuda"))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    forward_backward_loss(model, images, text)
    optimizer_step(model, optimizer, None, 1.0, skip=torch.zeros((), device="cuda"))
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    steps = {float(state["step"]) for state in optimizer.state.values()}
    assert steps == {1.0}  # the skipped step is not counted in Adam's bias correction


def test_a_raw_batch_pins_its_images_and_tokens():
    from topoclip.data.batch import RawBatch

    text = batch_for(load_config("tiny").model, 2, "cpu")
    pinned = RawBatch(torch.zeros(2, 3, 8, 8), ["a", "b"], {}, text).pin_memory()
    assert pinned.images.is_pinned() and pinned.text.input_ids.is_pinned() and pinned.text.attention_mask.is_pinned()


def test_a_diverging_cuda_run_stops_in_one_line_without_saving_bad_weights(tmp_path, capsys):
    """On CUDA the trainer reads values only at log/checkpoint steps; the non-finite policy must still hold."""
    from topoclip.io.checkpoint import step_checkpoints
    from topoclip.cli import main

    run = tmp_path / "run"
    # τ = exp(101) is past fp32's range: every loss is non-finite (train.lr, the old lever, is bounded now)
    settings = ["train.steps=40", "model.temperature.max_scale=1e44", "model.temperature.init=101", "train.checkpoint_every=10", "train.log_every=5",
                "train.device=cuda", "evaluate.size=32", "data.scenes.train_size=512", "data.scenes.test_size=64"]
    assert main(["train", "--preset", "tiny", "--quiet", *[a for s in settings for a in ("--set", s)],
                 "--out", str(run)]) == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert "training stopped at step" in line and "non-finite" in line
    assert not step_checkpoints(run / "checkpoints")


def test_batches_prefetched_to_the_gpu_arrive_whole_and_in_order():
    from topoclip.data.batch import RawBatch
    from topoclip.run.training.data import prefetch_to_device

    config = load_config("tiny").model
    sent = [RawBatch(torch.randn(64, 3, 32, 32).pin_memory(), ["x"] * 64, {}, batch_for(config, 64, "cpu").pin_memory())
            for _ in range(4)]
    for original, arrived in zip(sent, prefetch_to_device(iter(sent), torch.device("cuda"))):
        assert arrived.images.is_cuda and arrived.text.input_ids.is_cuda
        torch.testing.assert_close(arrived.images.cpu(), original.images, atol=0, rtol=0)  # a copy
        assert torch.equal(arrived.text.input_ids.cpu(), original.text.input_ids)
