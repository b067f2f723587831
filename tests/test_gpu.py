"""CUDA checks (run with `pytest --run-gpu` on a GPU machine; skipped elsewhere)."""
import pytest
import torch

from topoclip.config import load_config
from topoclip.geometry import similarity, to_space
from topoclip.model import CLIP
from topoclip.tokenizer import TextBatch
from topoclip.training.step import forward_backward

pytestmark = pytest.mark.gpu


def batch_for(config, batch, device):
    ids = torch.randint(5, config.text.vocab_size, (batch, config.text.context_length), device=device)
    ids[:, 0] = config.text.cls_token_id
    return TextBatch(ids, torch.ones_like(ids, dtype=torch.bool))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_cuda_step_is_finite_at_tau_100(precision):
    config = load_config("tiny", ["model.temperature.init=4.6052"]).model
    model = CLIP(config).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    images, text = torch.randn(64, 3, 32, 32, device="cuda"), batch_for(config, 64, "cuda")
    if precision != "fp16":
        loss = forward_backward(model, images, text, precision=precision)
        assert loss == loss and abs(loss) < 1e4
        for name, parameter in model.named_parameters():
            assert torch.isfinite(parameter.grad).all(), name
        return
    # fp16: the scaler starts at 2^16 and may overflow first; it must settle on a finite step.
    scaler = torch.amp.GradScaler("cuda")
    for _ in range(20):
        optimizer.zero_grad(set_to_none=True)
        loss = forward_backward(model, images, text, precision=precision, scaler=scaler)
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
    torch.testing.assert_close(cpu, gpu, atol=1e-4, rtol=1e-4)


def test_geodesic_16k_by_16k_in_chunks_fits_memory():
    u = to_space("ps-geodesic", torch.randn(16384, 16, 32, device="cuda"))
    torch.cuda.reset_peak_memory_stats()
    s = similarity("ps-geodesic", u, u)
    peak = torch.cuda.max_memory_allocated()
    full_intermediate = 16384 * 16384 * 16 * 4  # the (b, b, m) fp32 tensor a naive version holds: 16 GiB
    assert s.shape == (16384, 16384) and peak < full_intermediate / 8
    assert torch.isfinite(s).all()


def test_cuda_training_run(tmp_path):
    from topoclip.training.trainer import train

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
    assert compiled == pytest.approx(eager, rel=1e-4, abs=1e-4)
    torch.testing.assert_close(model.visual.conv1.weight.grad, eager_grad, atol=1e-4, rtol=1e-3)
