"""Config: presets as data, type-checked overrides, refusal of configs that cannot work."""
import dataclasses
import json
import math
import re
import typing

import pytest

import topoclip
from topoclip.config import (NUMERIC_RANGES, Config, ConfigError, DataConfig, EvaluateConfig, TrainConfig, load_config,
                             parse_value, preset_dict, to_dict,
                             valid_keys)
from topoclip.core.errors import UserError


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
    with pytest.raises(ConfigError, match="unknown key 'model.n_token'; did you mean model.class_tokens"):
        load_config("tiny", ["model.n_token=16"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config("tiny", ["model.class_tokens"])


@pytest.mark.parametrize("override, message", [
    (["model.class_tokens=0"], r"model.class_tokens=0 must be an integer in \[1, 4,096\]"),
    (["model.vision.heads=5"], "model.vision.width=64 is not divisible by model.vision.heads=5"),
    (["model.text.heads=3"], "model.text.width=64 is not divisible"),
    (["model.topology=hyperbolic"], "model.topology='hyperbolic' is unknown"),
    (["model.spheres=3"], "not divisible by model.spheres=3"),
    (["model.topology=sphere", "model.spheres=4"], "only applies to product-sphere"),
    (["model.vision.patch_size=4096"], "is smaller than one patch (model.vision.patch_size=4096)"),
    (["train.batch_size=10", "train.accumulation_steps=3"], "not divisible by train.accumulation_steps"),
    (["data.scenes.train_size=16"], "data.scenes.train_size=16 is smaller than train.batch_size=32"),
    (["data.scenes.test_size=0"], "data.scenes.test_size=0 leaves the final evaluation no image"),
    (["train.eval_every=5", "data.scenes.val_size=0"], "data.scenes.val_size=0 leaves the evaluations"),
    (["data.augment_scale=[0.9, 0.5]"], "must satisfy low ≤ high"),
    (["data.source=shards", "data.train_data=x.tar", "data.resampled=true", "data.samples_per_epoch=8",
      "data.weights=[0, 0]"], "has no positive weight"),
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


def test_unknown_preset_lists_only_public_names():
    with pytest.raises(ConfigError, match="unknown preset 'nope'.*cpu-multi") as caught:
        preset_dict("nope")
    assert "_cpu" not in str(caught.value) and "_paper-text" not in str(caught.value)
    with pytest.raises(ConfigError, match="did you mean 'tiny'"):
        preset_dict("tiyn")


# Every bad value is refused by load_config with one ConfigError naming the key and the value. Values are
# given as a user types them after --set (JSON: NaN and Infinity parse to floats). On main, each of the
# first six passed validation and failed later (ZeroDivisionError, "negative dimension", NaN weights).
BAD_NUMBERS = [
    ("train.lr", "NaN"), ("train.lr", "Infinity"), ("train.weight_decay", "NaN"), ("model.temperature.init", "NaN"),
    ("model.vision.patch_size", "0"), ("model.vision.mlp_ratio", "-1"),
    ("train.lr", "-Infinity"), ("train.lr", "0"), ("train.lr", "-0.001"), ("train.weight_decay", "-0.1"),
    ("train.eps", "0"), ("train.grad_clip", "NaN"), ("train.grad_clip", "-1"), ("train.betas", "[0.9, NaN]"),
    ("train.betas", "[0.9, 1.0]"), ("train.warmup_steps", "-1"), ("train.eval_every", "-5"), ("train.seed", "-1"),
    ("train.steps", "0"), ("train.batch_size", "0"), ("train.checkpoint_every", "-1"), ("train.threads", "-2"),
    ("model.temperature.init", "Infinity"), ("model.temperature.max_scale", "0"),
    ("model.temperature.max_scale", "Infinity"), ("model.temperature.bias_init", "NaN"),
    ("model.vision.patch_size", "-8"), ("model.vision.width", "0"), ("model.vision.heads", "0"),
    ("model.vision.layers", "0"), ("model.vision.image_size", "0"), ("model.vision.mlp_ratio", "NaN"),
    ("model.vision.mlp_ratio", "0"), ("model.vision.std", "[0.2, 0, 0.2]"), ("model.vision.mean", "[0.5, NaN, 0.5]"),
    ("model.text.vocab_size", "0"), ("model.text.context_length", "1"), ("model.text.mlp_ratio", "-1"),
    ("model.text.cls_token_id", "-1"), ("model.class_tokens", "0"), ("model.embed_dim", "-4"), ("model.spheres", "-1"),
    ("data.max_bad_fraction", "NaN"), ("data.max_bad_fraction", "1.5"), ("data.augment_scale", "[0, 1]"),
    ("data.augment_scale", "[0.5, Infinity]"), ("data.shuffle_buffer", "-1"), ("data.samples_per_epoch", "-1"),
    ("data.weights", "[1, NaN]"), ("data.weights", "[1, -1]"), ("data.scenes.noise", "NaN"),
    ("data.scenes.noise", "1.5"), ("data.scenes.max_objects", "10"), ("data.scenes.image_size", "8"),
    ("evaluate.size", "0"), ("evaluate.validation_size", "0"), ("evaluate.batch_size", "0"),
    ("evaluate.captions_per_image", "0"),
]


@pytest.mark.parametrize("key, text", BAD_NUMBERS)
def test_every_bad_number_is_refused_naming_the_field_and_value(key, text):
    if key == "data.weights":  # weights need resampled shards to be read at all
        extra = ["data.source=shards", "data.train_data=x.tar", "data.resampled=true", "data.samples_per_epoch=8"]
    else:
        extra = []
    with pytest.raises(ConfigError) as caught:
        load_config("tiny", extra + [f"{key}={text}"])
    message = str(caught.value)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, UserError)
    assert "\n" not in message and " must be " in message
    if key.startswith("data.scenes."):  # SceneConfig checks its own fields first, in its own words
        assert message.startswith("data.scenes: ") and key.rsplit(".", 1)[1] in message
    else:
        assert message.startswith(f"{key}=")


def test_nan_and_infinity_parse_as_floats():
    assert math.isnan(parse_value("NaN")) and parse_value("Infinity") == math.inf and parse_value("-Infinity") == -math.inf


def test_messages_name_the_range_and_a_fix():
    with pytest.raises(ConfigError, match=r"^train.lr=NaN must be a finite number in \(0, 10\] \(AdamW moves every weight "
                                          r"by about lr a step\); e.g. train.lr=0.0005 \(the default\)$"):
        load_config("tiny", ["train.lr=NaN"])
    with pytest.raises(ConfigError, match=r"train.weight_decay=NaN must be a finite number ≥ 0 \(0 turns it off\)"):
        load_config("tiny", ["train.weight_decay=NaN"])
    with pytest.raises(ConfigError, match=r"model.vision.patch_size=0 must be an integer ≥ 1"):
        load_config("tiny", ["model.vision.patch_size=0"])
    with pytest.raises(ConfigError, match=r"smaller than one patch \(model.vision.patch_size=4096\); pick a patch size at "
                                          r"most the image size"):
        load_config("tiny", ["model.vision.patch_size=4096"])


def _is_numeric(annotation) -> bool:
    """int, float, Optional of those, a list / tuple of them, or a number or a named choice (train.num_workers: int or
    "auto"), whose number needs its range all the same."""
    if annotation in (int, float):
        return True
    args = set(typing.get_args(annotation)) - {type(None), Ellipsis}
    if typing.get_origin(annotation) in (list, tuple):
        return bool(args) and args <= {int, float}
    words = {arg for arg in args if typing.get_origin(arg) is typing.Literal}
    return typing.get_origin(annotation) is typing.Union and bool(args - words) and all(map(_is_numeric, args - words))


def _numeric_keys(cls=Config, prefix=""):
    """Dotted keys of every numeric field (see _is_numeric), nested sections expanded."""
    keys = []
    for name, annotation in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(annotation):
            keys += _numeric_keys(annotation, prefix + name + ".")
        elif _is_numeric(annotation):
            keys.append(prefix + name)
    return keys


def test_the_range_table_covers_every_numeric_field():
    numeric = set(_numeric_keys())
    assert {"train.lr", "train.betas", "model.temperature.bias_init", "data.weights", "data.scenes.noise"} <= numeric
    assert set(NUMERIC_RANGES) == numeric  # a new numeric setting needs its range here


@pytest.mark.parametrize("typed, suggestion", [
    ("train.lrr", "train.lr"), ("lr", "train.lr"), ("model.vision.patchsize", "model.vision.patch_size"),
    ("trian.steps", "train.steps"), ("data.scenes.noize", "data.scenes.noise"), ("batch_size", "train.batch_size"),
])
def test_unknown_key_says_did_you_mean(typed, suggestion):
    with pytest.raises(ConfigError) as caught:
        load_config("tiny", [f"{typed}=1"])
    message = str(caught.value)
    assert message.startswith(f"unknown key {typed!r}; did you mean {suggestion}")
    largest = max(len(dataclasses.fields(section)) for section in (TrainConfig, DataConfig, EvaluateConfig))
    assert message.count(",") < largest + 2  # one section's keys at most, not all ~90


def test_unknown_key_lists_at_most_one_section():
    with pytest.raises(ConfigError) as caught:
        load_config("tiny", ["model.vision.patchsize=8"])
    listed = str(caught.value).split("keys under model.vision.: ")[1]
    assert "model.vision.width" in listed and "train." not in listed and "model.text." not in listed
    with pytest.raises(ConfigError, match=r"^unknown key 'zzz' \(sections: model.…, train.…, data.…, evaluate.…, name\)$"):
        load_config("tiny", ["zzz=1"])


@pytest.mark.parametrize("setting,memory", [
    ("model.text.vocab_size=1000000000000", "16 GiB at 4,194,304"),  # before: a Rust abort in the tokenizer
    ("data.scenes.train_size=1000000000000", "800 MB and 300 GB at 10^8"),  # before: an allocation failure
    ("evaluate.size=1000000000000", "3 GB of pixels at 10^6"),  # before: a hang
    ("model.vision.width=100000", "12 GiB at 16384"),
    ("train.lr=1e38", "AdamW moves every weight by about lr a step"),  # before: an overflow traceback in AdamW
])
def test_sizes_have_bounds_that_name_their_memory(setting, memory):
    key = setting.split("=")[0]
    with pytest.raises(ConfigError, match=re.escape(key) + r"=\S+ must be .* in (\[|\()") as refused:
        load_config("tiny", [setting])
    assert memory in str(refused.value)


def test_malformed_presets_and_deep_values_are_config_errors(tmp_path):
    from topoclip.config import load_config as load

    broken = tmp_path / "broken.json"
    broken.write_text('{"model": {')
    with pytest.raises(ConfigError, match="preset file .*broken.json is not valid JSON"):
        load(str(broken))
    listed = tmp_path / "list.json"
    listed.write_text("[1]")
    with pytest.raises(ConfigError, match="holds a JSON list, not an object"):
        load(str(listed))
    loop = tmp_path / "loop.json"
    loop.write_text(json.dumps({"base": str(loop)}))
    with pytest.raises(ConfigError, match="is a loop"):
        load(str(loop))
    with pytest.raises(ConfigError, match="nests lists 50000 deep"):
        load("tiny", ["data.weights=" + "[" * 50000 + "]" * 50000])


def test_data_sources_are_a_registry(tmp_path, capsys):
    from topoclip.cli import main
    from topoclip.data.sources import SOURCES, epoch_steps

    assert sorted(SOURCES) == ["csv", "hf", "scenes", "shards"]
    assert [name for name, source in SOURCES.items() if not source.stream] == ["scenes"]
    config = load_config("tiny")
    assert epoch_steps(config.data, 64) == -(-config.data.scenes.train_size // 64)
    with pytest.raises(ConfigError, match=r"data.source='lmdb' is unknown; choose one of \['csv', 'hf', 'scenes', 'shards'\]"):
        load_config("tiny", ["data.source=lmdb"])
    assert main(["train", "--preset", "tiny", "--out", str(tmp_path / "run"), "--set", "data.source=lmdb"]) == 2
    assert capsys.readouterr().err.count("\n") == 1  # one line, no traceback


def test_a_loaded_config_is_frozen_in_every_section():
    # The CLI used to edit a loaded config in place (--imagenet-val, eval's template mode); now nothing can.
    config = load_config("tiny")
    for section in (config, config.model, config.model.vision, config.model.text, config.model.temperature,
                    config.train, config.data, config.data.scenes, config.evaluate):
        field = dataclasses.fields(section)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, field, getattr(section, field))
