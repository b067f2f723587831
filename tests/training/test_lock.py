"""Locked towers (LiT) and partial unlocking, as OpenCLIP's --lock-image / --lock-text."""
import pytest
import torch
from safetensors.torch import load_file

from topoclip.io.checkpoint import WEIGHTS, step_checkpoints
from topoclip.cli import main
from topoclip.config import ConfigError, load_config
from topoclip.model.clip import CLIP
from topoclip.run.training.lock import lock_tower, tower_groups
from topoclip.run.training.optim import build_optimizer

STEPS = ["--set", "train.steps=20", "--set", "train.lr=0.01", "--set", "evaluate.size=16", "--set",
         "train.checkpoint_every=0"]


def final_weights(run):
    return load_file(step_checkpoints(run / "checkpoints")[-1] / WEIGHTS)


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """A tiny run's weights and tokenizer, the starting point of every locked run below (--init-from)."""
    run = tmp_path_factory.mktemp("start") / "run"
    assert main(["train", "--preset", "tiny", "--quiet", "--out", str(run), "--set", "train.steps=1",
                 "--set", "evaluate.size=16"]) == 0
    return step_checkpoints(run / "checkpoints")[-1]


@pytest.mark.slow
def test_a_locked_image_tower_is_bit_identical_after_training_while_the_text_tower_moves(start, tmp_path):
    run = tmp_path / "locked"
    assert main(["train", "--init-from", str(start), "--quiet", "--out", str(run), "--set", "train.lock_image=true",
                 *STEPS]) == 0
    before, after = load_file(start / WEIGHTS), final_weights(run)
    image = [name for name in before if name.startswith("visual.")]
    text = [name for name in before if name.startswith("text.")]
    assert image and all(torch.equal(before[name], after[name]) for name in image)
    assert all(not torch.equal(before[name], after[name]) for name in text)  # every text weight trained


@pytest.mark.slow
def test_unlocked_groups_train_and_the_rest_stays(start, tmp_path):
    run = tmp_path / "partly"
    assert main(["train", "--init-from", str(start), "--quiet", "--out", str(run), "--set", "train.lock_image=true",
                 "--set", "train.lock_image_unlocked_groups=2", *STEPS]) == 0  # tiny: 2 blocks -> 4 groups
    before, after = load_file(start / WEIGHTS), final_weights(run)
    moved = {name for name in before if name.startswith("visual.") and not torch.equal(before[name], after[name])}
    # The last two groups: [the last block, ln_post] and the projection.
    assert moved == {name for name in before if name.startswith(("visual.transformer.resblocks.1.", "visual.ln_post.",
                                                                  "visual.proj"))}


def test_locked_parameters_are_left_out_of_the_optimiser_and_groups_are_openclip_s():
    config = load_config("tiny", ["train.lock_text=true", "train.lock_text_unlocked_layers=1"])
    model = CLIP(config.model)
    groups = tower_groups(model.text, "text")
    assert len(groups) == config.model.text.layers + 2 and groups[-1] == [model.text.text_projection]
    lock_tower(model.text, "text", 1)
    optimised = {id(p) for group in build_optimizer(model, config.train).param_groups for p in group["params"]}
    trainable = {name for name, p in model.named_parameters() if id(p) in optimised}
    assert {name for name in trainable if name.startswith("text.")} == {"text.text_projection"}
    assert any(name.startswith("visual.") for name in trainable)


@pytest.mark.parametrize("settings, message", [
    (["train.lock_image_unlocked_groups=1"], "without train.lock_image=true"),
    (["train.lock_image=true", "train.lock_image_unlocked_groups=9"], "the image tower has 4 groups"),
    (["train.lock_image=true", "train.lock_text=true"], "lock both towers"),
])
def test_impossible_locks_are_refused_before_training(settings, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", settings)
