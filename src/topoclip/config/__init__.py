"""Typed configuration: dataclasses, named presets stored as JSON data, type-checked overrides.

A run is described by :class:`Config` (model, train, data, evaluate sections). Presets live in
``topoclip/preset_data/*.json``; a preset may name a ``"base"`` preset whose values it overrides.
``--set section.field=value`` overrides are parsed and type-checked against the dataclasses;
an unknown key is refused with the nearest valid ones ("did you mean"). Every number is then
range-checked (finite, and in the range NUMERIC_RANGES gives its field) before anything is built.
Nothing here executes code from a config.

The package in three rooms: `schema` (the dataclasses, all the towers and the model import), `checks`
(ranges and rules) and `loading` (presets, overrides, dict <-> dataclass); this module gathers their
public names.
"""
from topoclip.config.checks import (FOLDER_GUARDED, NUMERIC_RANGES, Range, command_urls, numeric_fields, refuse_folder_commands,
                                    validate, validate_data, validate_evaluate, validate_model, validate_numbers,
                                    require_lora_library, validate_readable, validate_source, validate_train)
from topoclip.config.loading import (DEFAULT_PRESET, PRESET_PACKAGE, apply_overrides, coerce, describe_preset, flat_dict,
                                     from_dict, load_config, merge, override_value, parse_value, preset_dict, presets,
                                     read_preset_file, to_dict, unknown_key_message, valid_keys, with_overrides)
from topoclip.config.schema import (Config, ConfigError, CurvatureConfig, DataConfig, EvaluateConfig, ModelConfig, TemperatureConfig,
                                    TextConfig, TrainConfig, VisionConfig)


__all__ = ["FOLDER_GUARDED", "NUMERIC_RANGES", "Range", "command_urls", "numeric_fields", "refuse_folder_commands", "validate",
           "validate_data", "validate_evaluate", "validate_model", "validate_numbers", "require_lora_library", "validate_readable",
           "validate_source",
           "validate_train", "DEFAULT_PRESET", "PRESET_PACKAGE", "apply_overrides", "coerce", "describe_preset",
           "flat_dict", "from_dict", "load_config", "merge", "override_value", "parse_value", "preset_dict",
           "presets", "read_preset_file", "to_dict", "unknown_key_message", "valid_keys", "with_overrides", "Config", "ConfigError",
           "CurvatureConfig", "DataConfig", "EvaluateConfig", "ModelConfig", "TemperatureConfig", "TextConfig", "TrainConfig",
           "VisionConfig"]
