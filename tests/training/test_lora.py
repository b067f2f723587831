"""LoRA through peft (topoclip.model.lora): a fine-tune of a small pretrained model on a CSV in one command, whose
checkpoint is the merged model every reader loads, whose adapters peft itself loads onto the base weights, and which
resumes bit for bit."""
import json
import shutil

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from topoclip.cli import main
from topoclip.config import load_config
from topoclip.data.scenes import retrieval_set
from topoclip.config.schema import LORA_TARGETS
from topoclip.run.training.trainer import train

from _tolerance import fp32_pair, model_roundings

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.slow

STEPS = 12
TUNE = ["--set", "train.lora_rank=4", "--set", f"train.steps={STEPS}", "--set", "train.checkpoint_every=6",
        "--set", "evaluate.size=16", "--set", "train.lr=1e-3", "--batch-size", "8", "--workers", "0"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    config = load_config("tiny", ["train.steps=30", "evaluate.size=16", "train.eval_every=0"])
    return train(config, out_dir=tmp_path_factory.mktemp("pretrained") / "run", progress=False)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """48 scene images as PNG files and a CSV of (filepath, title), OpenCLIP's default columns."""
    folder = tmp_path_factory.mktemp("csv")
    pairs = retrieval_set(load_config("tiny").data.scenes, "train", 48, captions_per_image=1)
    rows = ["filepath,title"]
    for index, (image, caption) in enumerate(zip(pairs.images, pairs.captions)):
        Image.fromarray(image).save(folder / f"{index}.png")
        rows.append(f"{index}.png,\"{caption}\"")
    (folder / "pairs.csv").write_text("\n".join(rows) + "\n")
    return folder / "pairs.csv"


@pytest.fixture(scope="module")
def tuned(pretrained, table, tmp_path_factory):
    out = tmp_path_factory.mktemp("tuned") / "run"
    assert main(["train", "--init-from", str(pretrained), "--train-data", str(table), *TUNE, "--out", str(out)]) == 0
    return out


def final(run):
    return run / "checkpoints" / f"step-{STEPS:06d}"


def adapted(name):
    return name.startswith(("visual.", "text.")) and name.removesuffix(".weight").endswith(LORA_TARGETS)


def test_only_the_adapted_weights_and_tau_change(pretrained, tuned):
    base = load_file(pretrained / "checkpoints" / "step-000030" / "model.safetensors")
    merged = load_file(final(tuned) / "model.safetensors")
    assert merged.keys() == base.keys()  # a plain CLIP's weights: every reader loads them as any other
    changed = {name for name in base if not torch.equal(base[name], merged[name])}
    assert changed - {"temperature.t"} == {name for name in base if adapted(name)}
    assert json.loads((final(tuned) / "lora" / "adapter_config.json").read_text())["r"] == 4


def test_peft_loads_the_adapters_onto_the_base_with_the_merged_model_s_features(pretrained, tuned):
    import topoclip

    merged, base = topoclip.load(tuned), topoclip.load(pretrained)
    with_adapters = peft.PeftModel.from_pretrained(base.model, str(final(tuned) / "lora")).eval()
    texts = ["a red square", "two blue circles at the top"]
    images = torch.rand(2, 3, merged.config.model.vision.image_size, merged.config.model.vision.image_size)
    # x·(W + ΔW) against x·W + (x·A)·B·s: the same products summed in another order, within the towers' fp32
    # rounding bound (tests/_tolerance.py) on unit vectors.
    bound = fp32_pair(model_roundings(merged.config.model, batch=2))
    with torch.no_grad():
        torch.testing.assert_close(with_adapters.base_model.model.encode_image(images),
                                   merged.model.encode_image(images), **bound)
    ids = merged.tokenizer(texts)
    with torch.no_grad():
        torch.testing.assert_close(with_adapters.base_model.model.encode_text(ids), merged.model.encode_text(ids), **bound)


def without_its_last_checkpoint(run, folder):
    """A copy of the finished `run` at `folder` as a run killed before its last checkpoint leaves it."""
    shutil.copytree(run, folder)
    shutil.rmtree(final(folder))
    (folder / "eval.json").unlink()
    return folder


def assert_same_final_weights(run, other):
    for name in ("model.safetensors", "lora/adapter_model.safetensors"):
        ours, theirs = load_file(final(run) / name), load_file(final(other) / name)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in ours), name


def test_a_lora_run_resumes_bit_for_bit(tuned, tmp_path):
    again = without_its_last_checkpoint(tuned, tmp_path / "again")
    assert main(["train", "--resume", str(again)]) == 0
    assert_same_final_weights(again, tuned)


def test_a_lora_run_with_dropout_resumes_bit_for_bit(pretrained, table, tmp_path):
    """Dropout draws from torch's global RNG, which a resume restores: nothing may draw from it in between (a data
    loader's base seed did: topoclip.data.batch.loader_generator)."""
    dropout = ["--set", "train.lora_dropout=0.3", "--set", 'train.lora_targets=["mlp.c_fc","mlp.c_proj","attn.out_proj"]']
    whole = tmp_path / "whole"
    assert main(["train", "--init-from", str(pretrained), "--train-data", str(table), *TUNE, *dropout,
                 "--out", str(whole)]) == 0
    again = without_its_last_checkpoint(whole, tmp_path / "again")
    assert main(["train", "--resume", str(again)]) == 0
    assert_same_final_weights(again, whole)


def test_the_packed_projection_alone_is_adapted(pretrained, table, tmp_path):
    """train.lora_targets=["attn.in_proj_weight"]: peft given no layer (an empty list: None would make it look up
    a transformers model type) and the packed q/k/v of every block; only they and τ change."""
    out = tmp_path / "qkv"
    assert main(["train", "--init-from", str(pretrained), "--train-data", str(table), *TUNE,
                 "--set", 'train.lora_targets=["attn.in_proj_weight"]', "--out", str(out)]) == 0
    base = load_file(pretrained / "checkpoints" / "step-000030" / "model.safetensors")
    merged = load_file(final(out) / "model.safetensors")
    changed = {name for name in base if not torch.equal(base[name], merged[name])}
    assert changed == {"temperature.t"} | {name for name in base if name.endswith("attn.in_proj_weight")}


def test_a_lora_run_loads_without_peft_and_says_it_is_needed_to_train(tuned, monkeypatch, capsys):
    import importlib.util

    import topoclip

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "peft" else real(name, *args))
    assert topoclip.load(tuned).config.train.lora_rank == 4  # the merged model: no peft needed
    assert main(["train", "--resume", str(tuned), "--set", f"train.steps={STEPS + 2}"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "pip install 'topoclip[lora]'" in error, error


def test_adapters_of_another_type_are_one_line_before_they_are_read(tuned, tmp_path, capsys):
    """Checked by name, shape and type from the file's header: int8 adapters would load, truncated, without it."""
    from safetensors.torch import save_file

    again = without_its_last_checkpoint(tuned, tmp_path / "again")
    earlier = sorted((again / "checkpoints").glob("step-*"))[-1] / "lora" / "adapter_model.safetensors"
    save_file({name: tensor.to(torch.int8) for name, tensor in load_file(earlier).items()}, str(earlier))
    assert main(["train", "--resume", str(again)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "does not hold this run's adapters" in error, error


def test_a_lora_run_exports_the_merged_model(tuned, tmp_path):
    import topoclip

    assert main(["export", str(tuned), "--weights", str(tmp_path / "weights"), "--onnx", str(tmp_path / "onnx")]) == 0
    exported, merged = load_file(tmp_path / "weights" / "model.safetensors"), load_file(final(tuned) / "model.safetensors")
    assert all(torch.equal(exported[name], merged[name]) for name in merged)
    assert topoclip.load(tmp_path / "weights").config.train.lora_rank == 4


@pytest.mark.parametrize("settings, message", [
    (["train.lora_targets=[\"attn.qkv\"]"], "give one or more of attn.in_proj_weight"),
    (["train.lora_towers=[]"], "give one or more of image, text"),
    (["train.lock_image=true"], "which train.lock_image locks"),
    (["train.parallelism=fsdp"], "use train.parallelism=ddp"),
    (["train.lora_rank=100000"], "train.lora_rank"),
    (["train.lora_rank=65"], "more than the width of a tower"),
    (["train.lora_dropout=0.1"], "drop attn.in_proj_weight from train.lora_targets"),
])
def test_impossible_lora_settings_are_one_line_before_training(settings, message, tmp_path, capsys):
    sets = [part for setting in ["train.lora_rank=4", *settings] for part in ("--set", setting)]
    assert main(["train", "--preset", "tiny", *sets, "--out", str(tmp_path / "run")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error, error
    assert not (tmp_path / "run").exists()
