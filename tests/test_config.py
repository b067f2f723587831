"""Config: presets as data, type-checked overrides, refusal of configs that cannot work."""
import json

import pytest

import topoclip
from topoclip.config import ConfigError, load_config, preset_dict, to_dict, valid_keys


def test_presets_are_listed_and_resolve_their_base():
    names = topoclip.presets()
    for required in ["sphere-vit-b16", "multi-32x16-vit-b16", "ps-inner-64x8-vit-s16", "multi-64x8-vit-s16",
                     "multi-16x32-vit-s16", "ps-inner-256x2-vit-s16", "ps-inner-16x32-vit-s16",
                     "ps-inner-4x128-vit-s16", "euclidean-vit-s16", "ps-geodesic-64x8-vit-s16", "openclip-ref", "tiny"]:
        assert required in names
    assert not any(name.startswith("_") for name in names)
    multi = load_config("multi-32x16-vit-b16")
    assert (multi.model.class_tokens, multi.model.embed_dim, multi.model.temperature.max_scale) == (16, 32, 3.95)
    assert multi.model.vision.width == 768 and multi.model.text.width == 512  # from the bases
    assert multi.train.batch_size == 32768 and multi.train.betas == (0.9, 0.998)


def test_overrides_are_type_checked():
    config = load_config("tiny", ["model.class_tokens=8", "train.lr=0.01", "model.topology=sphere", "train.betas=[0.8,0.9]"])
    assert config.model.class_tokens == 8 and config.train.lr == 0.01 and config.train.betas == (0.8, 0.9)
    with pytest.raises(ConfigError, match="must be an integer"):
        load_config("tiny", ["model.class_tokens=many"])
    with pytest.raises(ConfigError, match="must be an integer"):
        load_config("tiny", ["model.class_tokens=1.5"])
    with pytest.raises(ConfigError, match="must be one of"):
        load_config("tiny", ["train.precision=fp8"])
    with pytest.raises(ConfigError, match="unknown key 'model.n_token'.*model.class_tokens"):
        load_config("tiny", ["model.n_token=16"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config("tiny", ["model.class_tokens"])


@pytest.mark.parametrize("override, message", [
    (["model.class_tokens=0"], "model.class_tokens=0 must be ≥ 1"),
    (["model.vision.heads=5"], "model.vision.width=64 is not divisible by model.vision.heads=5"),
    (["model.text.heads=3"], "model.text.width=64 is not divisible"),
    (["model.topology=hyperbolic"], "model.topology='hyperbolic' is unknown"),
    (["model.spheres=3"], "not divisible by model.spheres=3"),
    (["model.topology=sphere", "model.spheres=4"], "only applies to product-sphere"),
    (["model.vision.patch_size=5"], "not a multiple of model.vision.patch_size=5"),
    (["train.batch_size=10", "train.accumulation_steps=3"], "not divisible by train.accumulation_steps"),
])
def test_configs_that_cannot_work_are_refused(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config("tiny", override)


def test_round_trip_through_json():
    config = load_config("multi-64x8-vit-s16")
    again = load_config(values=json.loads(json.dumps(to_dict(config))))
    assert again == config


def test_valid_keys_cover_nested_sections():
    keys = valid_keys()
    assert "model.vision.width" in keys and "model.temperature.max_scale" in keys and "train.lr" in keys


def test_unknown_preset_lists_the_names():
    with pytest.raises(ConfigError, match="unknown preset 'nope'.*cpu-multi"):
        preset_dict("nope")
