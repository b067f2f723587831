"""`topoclip push`: the files and the model card it sends, against a local fake of huggingface_hub's HfApi."""
import json
import os

import pytest

from topoclip.cli import main
from topoclip.config import load_config
from topoclip.run.training.trainer import train

OPENAI_LAYOUT = ["model.topology=sphere", "model.class_tokens=1", "model.text.attention=causal",
                 "model.text.pooling=end_of_text", "model.text.norm_first=true", "model.text.embedding_norm=false"]


class FakeApi:
    """Records what would go to the Hub: the repository created and the folder's files."""

    calls: list = []

    def __init__(self, token=None):
        self.token = token

    def create_repo(self, repo_id, private=False, exist_ok=False):
        FakeApi.calls.append(("create_repo", repo_id, private, exist_ok))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, folder_path, repo_id, commit_message):
        from pathlib import Path

        files = {path.name: path.read_bytes() for path in Path(folder_path).iterdir()}
        FakeApi.calls.append(("upload_folder", repo_id, commit_message, files))


@pytest.fixture(scope="module", params=["multi", "sphere"])
def run(request, tmp_path_factory):
    overrides = ["train.steps=2", "evaluate.size=16"] + (OPENAI_LAYOUT if request.param == "sphere" else [])
    return train(load_config("tiny", overrides), out_dir=tmp_path_factory.mktemp("push") / "run", progress=False)


@pytest.mark.slow
def test_push_sends_the_exported_model_and_a_card(run, monkeypatch, capsys):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    FakeApi.calls = []
    assert main(["push", str(run), "someone/tiny", "--private"]) == 0
    assert "pushed: https://huggingface.co/someone/tiny" in capsys.readouterr().out
    (create, upload) = FakeApi.calls
    assert create == ("create_repo", "someone/tiny", True, True)
    files = upload[3]
    sphere = json.loads(files["topoclip_config.json"])["model"]["topology"] == "sphere"
    expected = {"model.safetensors", "topoclip_config.json", "tokenizer.json", "README.md"}
    if sphere:  # OpenCLIP can express it: its files go too, with what routes get_tokenizer to tokenizer.json
        expected |= {"open_clip_config.json", "open_clip_model.safetensors", "tokenizer_config.json"}
        text = json.loads(files["open_clip_config.json"])["model_cfg"]["text_cfg"]
        assert text["hf_tokenizer_name"] == "someone/tiny" and text["pool_type"] == "eos"
    assert set(files) == expected and "config.json" not in files  # no clash with transformers' config.json
    card = files["README.md"].decode()
    assert card.startswith("---\nlicense: mit\nlibrary_name: topoclip\n")
    assert 'topoclip.load("someone/tiny")' in card and "## Evaluation" in card and "| shape | in-domain |" in card
    assert ("hf-hub:someone/tiny" in card) == sphere
    assert ("Sphere(" in card) if sphere else ("Multi(16,4)" in card)


def test_dry_run_writes_the_folder_and_uploads_nothing(run, tmp_path, capsys):
    assert main(["push", str(run), "someone/tiny", "--dry-run", str(tmp_path / "upload")]) == 0
    assert (tmp_path / "upload" / "README.md").is_file() and (tmp_path / "upload" / "model.safetensors").is_file()
    import topoclip

    assert topoclip.load(tmp_path / "upload").config.model == topoclip.load(run).config.model  # loads as a model


def test_a_repo_id_without_an_owner_is_refused(run, capsys):
    pytest.importorskip("huggingface_hub")
    assert main(["push", str(run), "tiny"]) == 2
    assert "give the repository as org/name" in capsys.readouterr().err


@pytest.mark.slow
def test_a_fine_tune_s_card_names_its_base_and_its_lora_and_its_license_is_asked_for(tmp_path, capsys):
    """From the review of #62: a LoRA fine-tune of `--pretrained NAME` was pushed with a card that never named the
    base model nor LoRA, under MIT whatever the base's license. A pretrained name's conversion
    (CACHE/pretrained/NAME--TAG/REVISION, as pretrained_folder lays it out) stands in for the Hub's weights here."""
    import shutil

    pytest.importorskip("peft")
    short = ["--set", "train.steps=2", "--set", "evaluate.size=8", "--set", "train.eval_every=0", "--set",
             "train.batch_size=8", "--quiet"]
    assert main(["train", "--preset", "tiny", *short, "--out", str(tmp_path / "scratch")]) == 0
    converted = tmp_path / "cache" / "pretrained" / "ViT-B-16--openai" / "main"
    shutil.copytree(tmp_path / "scratch" / "checkpoints" / "step-000002", converted)
    assert main(["train", "--init-from", str(converted), "--set", "train.lora_rank=2", *short,
                 "--out", str(tmp_path / "tuned")]) == 0
    capsys.readouterr()
    assert main(["push", str(tmp_path / "tuned"), "someone/tuned", "--dry-run", str(tmp_path / "refused")]) == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "fine-tuned from ViT-B-16:openai (openai/clip-vit-base-patch16), whose " \
                                      "license governs it: pass --license" in said
    assert not (tmp_path / "refused").exists()
    assert main(["push", str(tmp_path / "tuned"), "someone/tuned", "--license", "other",
                 "--dry-run", str(tmp_path / "upload")]) == 0
    card = (tmp_path / "upload" / "README.md").read_text()
    assert card.startswith("---\nlicense: other\nbase_model: openai/clip-vit-base-patch16\nbase_model_relation: finetune\n")
    assert "- fine-tuned from `ViT-B-16:openai`" in card and "- LoRA (peft): rank 2, alpha 16" in card
    assert "import pathlib" in card
    # a fine-tune of the fine-tune: the chain of train.init_from leads back to the same base (noticed in #62's note)
    assert main(["train", "--init-from", str(tmp_path / "tuned"), *short, "--out", str(tmp_path / "twice")]) == 0
    assert main(["push", str(tmp_path / "twice"), "someone/twice", "--license", "other",
                 "--dry-run", str(tmp_path / "upload2")]) == 0
    card = (tmp_path / "upload2" / "README.md").read_text()
    assert card.startswith("---\nlicense: other\nbase_model: openai/clip-vit-base-patch16\n")
    # a relative link is as typed where that run started, not a folder of this cwd: the chain ends there
    capsys.readouterr()
    assert main(["train", "--init-from", os.path.relpath(tmp_path / "tuned"), *short, "--out", str(tmp_path / "rel")]) == 0
    assert main(["push", str(tmp_path / "rel"), "someone/rel", "--license", "other",
                 "--dry-run", str(tmp_path / "upload3")]) == 0
    assert "- fine-tuned from a local checkpoint" in (tmp_path / "upload3" / "README.md").read_text()
    shutil.rmtree(tmp_path / "tuned")  # the chain's middle gone: a local checkpoint, its license still asked for
    capsys.readouterr()
    assert main(["push", str(tmp_path / "twice"), "someone/twice", "--dry-run", str(tmp_path / "refused2")]) == 2
    assert "fine-tuned from another checkpoint (train.init_from), whose license" in capsys.readouterr().err
    # a model trained from scratch keeps MIT as its default and has no base
    assert main(["push", str(tmp_path / "scratch"), "someone/scratch", "--dry-run", str(tmp_path / "mine")]) == 0
    card = (tmp_path / "mine" / "README.md").read_text()
    assert card.startswith("---\nlicense: mit\nlibrary_name: topoclip\n") and "fine-tuned" not in card


@pytest.mark.parametrize("license", ["yes", "No", "on", "null", "1.0", "0x10", "1mit"])
def test_a_license_yaml_would_read_as_another_type_is_refused(license, tmp_path, capsys):
    """From the second review of #62: the card's front matter took `--license yes` (YAML: true) or `1.0` (a number)."""
    assert main(["push", str(tmp_path), "someone/x", "--license", license, "--dry-run", str(tmp_path / "up")]) == 2
    assert f"--license {license!r} is not a license identifier" in capsys.readouterr().err


def test_a_hyperbolic_models_card_says_its_curvature(tmp_path):
    """From the hostile test of #61: the card of a lorentz model never said its learned c (and the export refusal
    spoke of class tokens)."""
    import torch

    from topoclip.io.checkpoint import save_checkpoint
    from topoclip.model.clip import CLIP
    from topoclip.preprocess.tokenizer import Tokenizer
    from topoclip.run.training.tokenizer_setup import fit_to_trained_tokenizer

    tokenizer = Tokenizer.train(["a red circle", "a blue square"], vocab_size=40, context_length=16)
    config = fit_to_trained_tokenizer(load_config("tiny", ["model.topology=lorentz", "model.class_tokens=1"]), tokenizer)
    model = CLIP(config.model)
    with torch.no_grad():
        model.curvature.log_c.fill_(-0.5)
    folder = save_checkpoint(tmp_path / "model", model, config, tokenizer)
    assert main(["push", str(folder), "someone/meru", "--dry-run", str(tmp_path / "up")]) == 0
    card = (tmp_path / "up" / "README.md").read_text()
    assert "hyperbolic space of curvature −c, c = 0.606531 (learned)" in card
    assert not (tmp_path / "up" / "open_clip_config.json").exists()
