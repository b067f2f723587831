"""Importing the authors' release: a model written in their layout from torch primitives,
saved, converted with `topoclip convert --from mtob`, loaded, gives their embeddings and similarities."""
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import topoclip
from _conversion_references import MtobCLIP
from _reference import ERNIE_MISSING, ERNIE_VOCAB
from topoclip.cli import main
from topoclip.io.convert.mtob import import_mtob
from topoclip.core.errors import CheckpointError

from _tolerance import fp32_pair, network_roundings

WORDS = ["a", "photo", "of", "the", "red", "blue", "cat", "dog", "on", "mat", "big", "small", "##s", "car", "tree"]
TEXTS = ["a photo of a cat", "the red dog on the mat", "small blue cars", "a big tree", "cat"]
# Our tower and the reference are two fp32 computations of the same unit-norm embeddings through
# ≤ 2 layers of width ≤ 128 and ≤ 20 tokens: within 2·γ_n of each other (tests/_tolerance.py), ≈ 2e-4,
# on any CPU. A wrong weight mapping errs by more than 1e-3 (test_wrong_heads_change_the_outputs).
TOLERANCE = fp32_pair(network_roundings(layers=2, width=128, context=20, batch=1))


def write_vocab(path: Path) -> Path:
    path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS) + "\n")
    return path


def save_reference(reference, path: Path) -> Path:
    state = {name: tensor.detach().clone().contiguous() for name, tensor in reference.state_dict().items()}
    if path.suffix == ".safetensors":
        save_file(state, path)
    else:
        torch.save(state, path)
    return path


def reference_outputs(reference, tokenizer, images):
    batch = tokenizer(TEXTS)
    with torch.no_grad():
        u, v = reference.visual(images), reference.encode_text(batch.input_ids, batch.attention_mask)
    return F.normalize(u, dim=-1), F.normalize(v, dim=-1), reference.similarity(u, v)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_imported_release_gives_the_original_similarities(tmp_path, suffix):
    reference = MtobCLIP(tokens=4, embed_dim=8, vocab=32, text_heads=2).eval()
    source = save_reference(reference, tmp_path / f"multi{suffix}")
    vocab = write_vocab(tmp_path / "vocab.txt")
    # Heads are not in the weights: width/64 by default (vision 128 -> 2), set for the 64-wide text (2, not 1).
    assert main(["convert", "--from", "mtob", str(source), str(tmp_path / "out"), "--vocab", str(vocab),
                 "--set", "model.text.heads=2"]) == 0
    clip = topoclip.load(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "topoclip_config.json").read_text())["model"]
    assert (config["class_tokens"], config["embed_dim"], config["topology"]) == (4, 8, "ps-inner")
    assert (config["text"]["context_length"], config["text"]["cls_token_id"], config["vision"]["heads"]) == (12, 2, 2)

    images = torch.randn(3, 3, 32, 32)
    u, v, similarity = reference_outputs(reference, clip.tokenizer, images)
    ours_u, ours_v = clip.encode_image(images), clip.encode_text(TEXTS)
    torch.testing.assert_close(ours_u, u, **TOLERANCE)
    torch.testing.assert_close(ours_v, v, **TOLERANCE)
    torch.testing.assert_close(clip.model.similarity(ours_u, ours_v), similarity, **TOLERANCE)
    assert float(similarity.abs().max()) > 0.5  # the comparison is not between near-zero numbers
    # τ is kept (for fine-tuning) but, as released, not part of the similarity.
    assert float(clip.model.temperature.t.detach()) == pytest.approx(2.659, abs=2.659 * 2.0**-24)  # one fp32 rounding


def test_wrong_heads_change_the_outputs(tmp_path):
    # The reason heads are an explicit setting: the default (64 / 64 = 1 head for the text) is not this model.
    reference = MtobCLIP(tokens=2, embed_dim=8, vocab=32, text_heads=2).eval()
    vocab = write_vocab(tmp_path / "vocab.txt")
    model, tokenizer, _ = import_mtob(reference.state_dict(), vocab)
    _, v, _ = reference_outputs(reference, tokenizer, torch.randn(1, 3, 32, 32))
    with torch.no_grad():
        ours = model.encode_text(tokenizer(TEXTS))
    assert float((ours - v).abs().max()) > 1e-3


def test_sphere_baseline_and_the_ernie_vocabulary(tmp_path):
    if ERNIE_VOCAB is None:
        pytest.skip(ERNIE_MISSING)
    reference = MtobCLIP(tokens=1, embed_dim=16, vocab=30522, context=20, text_heads=1, cls_id=101).eval()
    model, tokenizer, config = import_mtob(reference.state_dict(), ERNIE_VOCAB, name="sphere")
    assert (config.model.topology, config.model.text.cls_token_id, tokenizer.cls_id) == ("sphere", 101, 101)
    images = torch.randn(2, 3, 32, 32)
    u, v, similarity = reference_outputs(reference, tokenizer, images)
    with torch.no_grad():
        ours_u, ours_v = model.encode_image(images), model.encode_text(tokenizer(TEXTS))
    torch.testing.assert_close(ours_v, v, **TOLERANCE)
    torch.testing.assert_close(model.similarity(ours_u, ours_v), similarity, **TOLERANCE)


def test_a_foreign_key_is_refused_by_name(tmp_path):
    state = MtobCLIP(tokens=2, embed_dim=8, vocab=32).state_dict()
    state["transformer.pooler.weight"] = torch.zeros(2)
    with pytest.raises(CheckpointError, match="transformer.pooler.weight"):
        import_mtob(state)


def test_convert_refuses_a_folder_with_files(tmp_path, capsys):
    source = save_reference(MtobCLIP(tokens=2, embed_dim=8, vocab=32), tmp_path / "m.pt")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("keep me")
    assert main(["convert", "--from", "mtob", str(source), str(tmp_path / "busy")]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert (tmp_path / "busy" / "notes.txt").read_text() == "keep me"
