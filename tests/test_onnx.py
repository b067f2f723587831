"""ONNX export of the image and text encoders: dynamic batch, same numbers as PyTorch under onnxruntime."""
import json

import numpy as np
import pytest
import torch

pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")

from topoclip.run.training.tokenizer_setup import fit_to_trained_tokenizer
from topoclip.io.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from topoclip.cli import main  # noqa: E402
from topoclip.config import load_config  # noqa: E402
from topoclip.core.errors import UserError  # noqa: E402
from topoclip.io.export_onnx import compare_with_pytorch, example_inputs, export_onnx  # noqa: E402
from topoclip.model.clip import CLIP  # noqa: E402
from topoclip.preprocess.tokenizer import Tokenizer  # noqa: E402

from _tolerance import TINY, fp32_pair, model_roundings

OPENAI_LAYOUT = ["model.class_tokens=2", "model.embed_dim=32", "model.text.attention=causal",
                 "model.text.pooling=end_of_text", "model.text.norm_first=true", "model.text.embedding_norm=false",
                 "model.vision.activation=quick_gelu", "model.text.activation=quick_gelu"]


@pytest.mark.parametrize("overrides", [[], OPENAI_LAYOUT], ids=["multi-token", "openai-layout"])
def test_exported_encoders_match_pytorch(tmp_path, overrides):
    config = load_config("tiny", overrides)
    model = CLIP(config.model).eval()
    report = export_onnx(model, config, None, tmp_path / "onnx")
    assert "max abs difference" in report
    differences = compare_with_pytorch(model, config, tmp_path / "onnx", batch=5)  # exported with batch 2
    assert differences["image"] < 1e-5 and differences["text"] < 1e-5, differences
    session = onnxruntime.InferenceSession(str(tmp_path / "onnx" / "text_encoder.onnx"), providers=["CPUExecutionProvider"])
    inputs = example_inputs(config, 1)
    (embeddings,) = session.run(None, {"input_ids": inputs["input_ids"].numpy(),
                                       "attention_mask": inputs["attention_mask"].numpy()})
    assert embeddings.shape == (1, *model.embedding_shape)


def test_cli_export_writes_a_servable_folder(tmp_path, capsys):
    config = load_config("tiny")
    tokenizer = Tokenizer.train(["a red circle", "a blue square"], vocab_size=40, context_length=32)
    config = fit_to_trained_tokenizer(config, tokenizer)  # as the trainer does (a loaded Config is frozen)
    checkpoint = save_checkpoint(tmp_path / "ckpt", CLIP(config.model), config, tokenizer)
    assert main(["export", str(checkpoint), "--onnx", str(tmp_path / "served"), "--weights", str(tmp_path / "clean")]) == 0
    out = capsys.readouterr().out
    assert "onnxruntime vs PyTorch, max abs difference" in out
    assert sorted(p.name for p in (tmp_path / "served").iterdir()) == ["image_encoder.onnx", "text_encoder.onnx",
                                                                         "tokenizer.json", "topoclip_config.json"]
    assert json.loads((tmp_path / "served" / "topoclip_config.json").read_text())["model"]["class_tokens"] == 4
    assert sorted(p.name for p in (tmp_path / "clean").iterdir()) == ["model.safetensors", "tokenizer.json",
                                                                        "topoclip_config.json"]
    # Serving without topoclip: the HF tokenizers library pads and truncates from tokenizer.json alone.
    from tokenizers import Tokenizer as Backend

    encoding = Backend.from_file(str(tmp_path / "served" / "tokenizer.json")).encode("a red circle")
    assert len(encoding.ids) == 32 and encoding.ids[0] == tokenizer.cls_id
    session = onnxruntime.InferenceSession(str(tmp_path / "served" / "text_encoder.onnx"), providers=["CPUExecutionProvider"])
    (served,) = session.run(None, {"input_ids": np.array([encoding.ids]), "attention_mask": np.array([encoding.attention_mask])})
    model, _, _ = load_checkpoint(checkpoint)
    with torch.no_grad():
        expected = model.eval().encode_text(tokenizer(["a red circle"]))
    # onnxruntime and torch: two fp32 computations of unit-norm rows through the tiny text tower
    torch.testing.assert_close(torch.from_numpy(served), expected, **fp32_pair(model_roundings(TINY, 1)))


@pytest.mark.parametrize("topology", ["sphere", "ps-inner"])
def test_flat_onnx_vectors_have_the_model_s_similarity_as_inner_product(tmp_path, topology):
    overrides = [f"model.topology={topology}"] + (["model.class_tokens=1"] if topology == "sphere" else [])
    config = load_config("tiny", overrides)
    model = CLIP(config.model).eval()
    export_onnx(model, config, None, tmp_path / "flat", flat=True)
    inputs = example_inputs(config, 4, torch.Generator().manual_seed(2))
    images = onnxruntime.InferenceSession(str(tmp_path / "flat" / "image_encoder.onnx"), providers=["CPUExecutionProvider"])
    texts = onnxruntime.InferenceSession(str(tmp_path / "flat" / "text_encoder.onnx"), providers=["CPUExecutionProvider"])
    (u,) = images.run(None, {"images": inputs["images"].numpy()})
    (v,) = texts.run(None, {"input_ids": inputs["input_ids"].numpy(), "attention_mask": inputs["attention_mask"].numpy()})
    m, n = model.embedding_shape
    assert u.shape == (4, m * n) and v.shape == (4, m * n)
    with torch.no_grad():
        expected = model.similarity(model.encode_image(inputs["images"]),
                                    model.encode_text(inputs["input_ids"], inputs["attention_mask"].bool()))
    # Each side's embedding is within the towers' fp32 roundings of PyTorch's; the m·n-term product adds its own;
    # |s| ≤ m (m unit sub-spheres): the bound scales with m.
    torch.testing.assert_close(torch.from_numpy(u @ v.T), expected,
                               **fp32_pair(model_roundings(TINY, 4) + m * n, scale=m))


def test_flat_export_is_refused_for_a_topology_without_a_flat_form(tmp_path):
    config = load_config("tiny", ["model.topology=ps-geodesic"])
    with pytest.raises(UserError, match="--flat: ps-geodesic embeddings have no flat form"):
        export_onnx(CLIP(config.model), config, None, tmp_path / "flat", flat=True)
