"""Loading a configuration: named presets stored as JSON data (a preset may name a ``"base"`` it overrides),
type-checked ``--set section.field=value`` overrides (an unknown key is refused with the nearest valid ones),
and dict <-> dataclass conversion. Nothing here executes code from a config."""
from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional, Sequence, Union

from topoclip.config.checks import FOLDER_GUARDED, refuse_folder_commands, validate
from topoclip.config.schema import Config, ConfigError


# --------------------------------------------------------------------------- dict <-> dataclass


def to_dict(obj: Any) -> Any:
    """A dataclass (nested) -> plain JSON-able dict (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp` (converting int→float, list→tuple); raise ConfigError."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in args:
            if option is type(None):
                continue
            try:
                return coerce(value, option, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}={value!r} does not fit {_type_name(tp)}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}={value!r} must be one of {list(args)}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} must be a list")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{key}={value!r} must have {len(args)} items")
            return tuple(coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        items = [coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping of fields of {tp.__name__}")
        return from_dict(tp, value, prefix=key + ".")
    if tp is Any:
        return value
    if tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a mapping")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r} must be an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r:.80} must be a number")
        try:
            return float(value)
        except OverflowError:  # an integer of over 308 digits: past every float
            raise ConfigError(f"{key} is an integer of {len(str(value)):,} digits, past the largest float (1.8e308); "
                              f"give a number in range") from None
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r} must be a string")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{key}={value!r} must be {_type_name(tp)}")
    return value


def from_dict(cls: type, values: dict, prefix: str = "") -> Any:
    """Build dataclass `cls` from a (partial) dict; an unknown key raises ConfigError with the nearest ones."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(unknown_key_message(prefix + unknown[0]))
    kwargs = {name: coerce(value, hints[name], prefix + name) for name, value in values.items()}
    try:
        return cls(**kwargs)
    except ValueError as error:  # a section's own __post_init__ check
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {error}") from None


def merge(base: dict, update: dict) -> dict:
    """Deep-merge `update` into a copy of `base` (dicts merge, everything else replaces)."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def flat_dict(values: dict, separator: str = ".", prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 5e-4}} -> {"train.lr": 5e-4}: every leaf of nested dicts by its joined key."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flat_dict(value, separator, f"{prefix}{key}{separator}"))
        else:
            flat[prefix + key] = value
    return flat


def valid_keys(cls: type = None, prefix: str = "") -> list[str]:
    """Every dotted key `--set` accepts (nested dataclasses expanded)."""
    cls = cls or Config
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            keys += valid_keys(tp, prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


def unknown_key_message(key: str) -> str:
    """'unknown key K; did you mean A or B? (keys under S: ...)': close matches and one section's keys."""
    keys = valid_keys()
    leaves = {k: k.rsplit(".", 1)[-1] for k in keys}
    # Close to the whole key ("train.lrr" -> train.lr; only those nearly as close as the best), or
    # the same field name under a section ("lr" -> train.lr).
    scored = sorted(((difflib.SequenceMatcher(None, key, k).ratio(), k) for k in keys), reverse=True)
    close = [k for score, k in scored[:3] if score >= max(0.6, scored[0][0] - 0.1)]
    near_leaves = difflib.get_close_matches(key.rsplit(".", 1)[-1], sorted(set(leaves.values())), n=2, cutoff=0.8)
    same_field = [k for leaf in near_leaves for k in keys if leaves[k] == leaf]
    suggestions = list(dict.fromkeys(close + same_field))[:3]
    message = f"unknown key {key!r}"
    if suggestions:
        message += "; did you mean " + " or ".join(suggestions) + "?"
    section = _nearest_section(suggestions[0] if suggestions else key, keys)
    # The section's own fields; its subsections shown once each, as "model.vision.…".
    rests = [k[len(section):] for k in keys if k.startswith(section)]
    children = dict.fromkeys(section + rest.split(".", 1)[0] + (".…" if "." in rest else "") for rest in rests)
    where = f"keys under {section}" if section else "sections"
    return message + f" ({where}: {', '.join(children)})"


def _nearest_section(key: str, keys: list[str]) -> str:
    """The longest "a.b." prefix of `key` that is a section of Config ("" for the top level)."""
    sections = {k[: i + 1] for k in keys for i, char in enumerate(k) if char == "."}
    parts = key.split(".")[:-1]
    for length in range(len(parts), 0, -1):
        if ".".join(parts[:length]) + "." in sections:
            return ".".join(parts[:length]) + "."
    return ""


# --------------------------------------------------------------------------- overrides


def parse_value(text: str) -> Any:
    """`--set` value text -> JSON value when it parses (numbers, true/false, null, lists), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
    except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits(), 4,300)
        raise ConfigError(f"a --set value is a number of {len(text):,} digits ({text[:20]}...); every setting is far "
                          f"smaller (integers are 64-bit)") from None
    except RecursionError:  # "[[[[...": no setting nests lists more than one deep
        raise ConfigError(f"a --set value nests lists {text.count('[')} deep ({text[:20]}...); no setting takes "
                          f"more than one level of list, e.g. data.weights=[1.0, 3.0]") from None


def apply_overrides(values: dict, overrides: list[str]) -> dict:
    """Apply ["section.field=value", ...] to a config dict (checked later by from_dict)."""
    keys = valid_keys()
    out = values
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value, e.g. model.class_tokens=16")
        key, text = item.split("=", 1)
        key = key.strip()
        if key not in keys:
            raise ConfigError(unknown_key_message(key))
        update: Any = parse_value(text)
        for part in reversed(key.split(".")):
            update = {part: update}
        out = merge(out, update)
    return out


def with_overrides(config: Config, overrides: Sequence[str], command: str) -> Config:
    """A loaded checkpoint's config with `overrides` applied and checked. Its model settings are its weights', so a
    model.* override is refused in one line (`command` names who refuses): applied, it would be ignored or blamed on
    another setting."""
    model = [item for item in overrides if item.strip().startswith("model.")]
    if model:
        raise ConfigError(f"{command}: a checkpoint's model settings are its own (--set {model[0]:.60}); only train, "
                          f"data and evaluate settings can be changed")
    if not overrides:
        return config
    config = from_dict(Config, apply_overrides(to_dict(config), list(overrides)))
    validate(config)
    return config


def override_value(overrides: list[str], key: str) -> Any:
    """The value the last of `overrides` gives `key` (None when none names it)."""
    value = None
    for item in overrides:
        name, _, text = item.partition("=")
        if name.strip() == key:
            value = parse_value(text)
    return value


# --------------------------------------------------------------------------- presets


PRESET_PACKAGE = "topoclip.preset_data"
DEFAULT_PRESET = "cpu-multi"  # what `topoclip train` trains with no --preset


def _preset_files() -> dict[str, Any]:
    root = resources.files(PRESET_PACKAGE)
    return {Path(p.name).stem: p for p in root.iterdir() if p.name.endswith(".json")}


def presets() -> list[str]:
    """Names of the presets shipped with topoclip (names starting with "_" are bases, not listed)."""
    return sorted(name for name in _preset_files() if not name.startswith("_"))


def read_preset_file(path: Path) -> dict:
    """A preset JSON file's values (read through the door: a regular file, bounded); ConfigError naming the file
    when it is not a JSON object."""
    from topoclip.core.door import read_json

    return read_json(path, "preset file", expect=dict, error=ConfigError)


def preset_dict(name: str, _bases: tuple = (), files: Optional[list] = None) -> dict:
    """The preset's values as a dict, with its `base` chain resolved (a file path also works). `files`, when given,
    gets every preset file (not a shipped preset) the chain read: a file is anyone's, so a command in it is refused
    (`load_config`)."""
    shipped = _preset_files()
    if name in shipped:
        values = json.loads(shipped[name].read_text())
    elif Path(name).exists():  # a FIFO or a folder of that name is refused by the door, not read
        values = read_preset_file(Path(name))
        if files is not None:
            files.append(Path(name))
    else:
        close = difflib.get_close_matches(name, presets(), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"unknown preset {name!r:.200}; {hint}presets: {', '.join(presets())} "
                          f"(`topoclip presets` describes them; a path to a preset JSON file also works)")
    values.pop("description", None)
    own_name = values.get("name", Path(name).stem)
    base = values.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"preset {name!r}: its \"base\" is a {type(base).__name__}; name one preset, e.g. "
                          f'"base": "cpu-multi"')
    if base:
        if base in _bases or len(_bases) >= MAX_BASES:
            chain = ' -> '.join(_bases + (name, base))
            raise ConfigError(f"preset {name!r}: its base chain {chain[:300]} is a loop or longer than {MAX_BASES}; "
                              f"end it at a shipped preset")
        values = merge(preset_dict(base, _bases + (name,), files), values)
    values["name"] = own_name  # the run is named after the preset asked for, not its base
    return values


MAX_BASES = 16  # presets a "base" chain may pass through (the shipped ones use two)


def typed_values(overrides: Sequence[str]) -> dict:
    """FOLDER_GUARDED key -> the value the command line's `overrides` give it (None where they give none)."""
    return {key: override_value(list(overrides), key) for key in FOLDER_GUARDED}


def load_config(preset: Optional[str] = None, overrides: Optional[list[str]] = None, values: Optional[dict] = None,
                typed: Optional[Sequence[str]] = None, files: Sequence[Path] = ()) -> Config:
    """Resolve a preset (or explicit values) plus overrides into a validated Config.

    A file is data, never a command: when the config comes in part from a file (a preset file, or `files`, e.g. the
    grid file whose settings are among `overrides`), a data.train_data that runs a command or reads the network, or
    W&B's upload, is refused unless the user typed that value (`typed`: the command line's --set; default: every
    override is typed)."""
    read = list(files)
    merged = preset_dict(preset, files=read) if preset else {}
    if values:
        merged = merge(merged, values)
    merged = apply_overrides(merged, overrides or [])
    config = from_dict(Config, merged)
    validate(config)
    if read:
        refuse_folder_commands(config, read[0], typed_values(overrides or [] if typed is None else typed))
    return config


def describe_preset(name: str) -> str:
    files = _preset_files()
    return json.loads(files[name].read_text()).get("description", "") if name in files else ""
