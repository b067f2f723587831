"""A topoclip model out to OpenCLIP's files: loaded by the real open_clip where it imports (the side venv),
read back by topoclip's own importer everywhere, refused in one line where OpenCLIP cannot express it."""
import json

import pytest
import torch

from topoclip.checkpoint import load_checkpoint, save_checkpoint
from topoclip.cli import main
from topoclip.config import load_config
from topoclip.model import CLIP

from _tolerance import TINY, fp32_pair, model_roundings

OPENAI_LAYOUT = ["model.topology=sphere", "model.class_tokens=1", "model.text.attention=causal",
                 "model.text.pooling=end_of_text", "model.text.norm_first=true", "model.text.embedding_norm=false",
                 "model.vision.activation=quick_gelu", "model.text.activation=quick_gelu"]


@pytest.fixture()
def exported(tmp_path):
    config = load_config("tiny", OPENAI_LAYOUT)
    torch.manual_seed(0)
    checkpoint = save_checkpoint(tmp_path / "ckpt", CLIP(config.model), config)
    assert main(["export", str(checkpoint), "--openclip", str(tmp_path / "openclip")]) == 0
    return checkpoint, tmp_path / "openclip"


def inputs(config, batch=3):
    generator = torch.Generator().manual_seed(1)
    size, length, vocab = config.vision.image_size, config.text.context_length, config.text.vocab_size
    images = torch.randn(batch, 3, size, size, generator=generator)
    ids = torch.randint(1, vocab - 2, (batch, length), generator=generator)
    ids[:, 0], ids[:, 9:], ids[:, 8] = vocab - 2, 0, vocab - 1  # start, text, end-of-text (the largest id), padding
    return images, ids


def test_the_exported_files_read_back_into_the_same_model(exported, tmp_path):
    checkpoint, folder = exported
    cfg = json.loads((folder / "open_clip_config.json").read_text())
    assert cfg["model_cfg"]["quick_gelu"] is True and cfg["preprocess_cfg"]["resize_mode"] == "shortest"
    assert main(["convert", "--from", "openclip", str(folder), str(tmp_path / "back")]) == 0
    model, _, _ = load_checkpoint(checkpoint)
    again, _, config = load_checkpoint(tmp_path / "back")
    assert config.model.vision.eval_resize == "shortest"
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name


def test_open_clip_loads_the_export_with_topoclip_s_embeddings(exported):
    open_clip = pytest.importorskip("open_clip")
    checkpoint, folder = exported
    model, _, config = load_checkpoint(checkpoint)
    theirs, _, _ = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    theirs.eval()
    images, ids = inputs(config.model)
    with torch.no_grad():
        # Two fp32 runs of the same towers in other kernels: within the towers' rounding bound (unit vectors).
        bound = fp32_pair(model_roundings(TINY, 3))
        torch.testing.assert_close(theirs.encode_image(images, normalize=True), model.encode_image(images)[:, 0], **bound)
        torch.testing.assert_close(theirs.encode_text(ids, normalize=True), model.encode_text(ids, ids != 0)[:, 0], **bound)
        assert float(theirs.logit_scale.exp()) == pytest.approx(float(model.temperature.scale), rel=1e-6)


@pytest.mark.parametrize("overrides, reason", [
    ([], "one class token per tower on one sphere; this model is ps-inner with 4 class tokens"),
    (["model.topology=sphere", "model.class_tokens=1"], "its text tower is BERT-style"),
])
def test_models_openclip_cannot_express_are_refused_in_one_line(tmp_path, capsys, overrides, reason):
    config = load_config("tiny", overrides)
    checkpoint = save_checkpoint(tmp_path / "ckpt", CLIP(config.model), config)
    assert main(["export", str(checkpoint), "--openclip", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert reason in error and error.count("\n") == 1 and not (tmp_path / "out").exists()
