"""A run's settings from a YAML preset (configs/) and ``key=value`` overrides: unknown keys refused, every value
read as its field's declared type, data named beside the target (``{target}``) resolved."""

from __future__ import annotations

import dataclasses
import os

from ..errors import SpdInputError
from ..reading import read_yaml
from .distill import DistillConfig


def _coerce(value, type_text: str):
    """A YAML / command-line value as the field's declared type (``1e-4`` is a string to YAML 1.1)."""
    if value is None or isinstance(value, str) and value.strip().lower() in ("none", "null", "~", ""):
        if "None" in type_text:
            return None
        raise ValueError("a value is required")
    base = type_text.replace(" | None", "").strip()
    if base == "bool":
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "yes", "1", "on"):
            return True
        if str(value).lower() in ("false", "no", "0", "off"):
            return False
        raise ValueError("expected true or false")
    if base == "int":
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError("expected an integer")
        return int(value)
    if base == "float":
        if isinstance(value, bool):
            raise ValueError("expected a number")
        return float(value)
    if base == "str":
        return str(value)
    if base == "str | list[str]":  # one source, or a YAML list of them ([a.jsonl, b.jsonl] on the command line)
        import yaml

        value = yaml.safe_load(value) if isinstance(value, str) and value.lstrip().startswith("[") else value
        if isinstance(value, list):
            if not value or not all(isinstance(v, str) and v for v in value):
                raise ValueError("expected a non-empty list of paths or dataset ids")
            return value[0] if len(value) == 1 else list(value)
        return str(value)
    if base == "str | dict[str, str]":  # one held-out set, or named ones ({chat: a.jsonl} on the command line)
        import yaml

        value = yaml.safe_load(value) if isinstance(value, str) and value.lstrip().startswith("{") else value
        if isinstance(value, dict):
            if not value or not all(isinstance(k, str) and isinstance(v, str) and k and v for k, v in value.items()):
                raise ValueError("expected a non-empty mapping of set names to paths, e.g. {chat: chat.jsonl}")
            return dict(value)
        return str(value)
    if base.startswith("list"):
        import yaml

        value = yaml.safe_load(value) if isinstance(value, str) else value
        if not isinstance(value, list):
            raise ValueError("expected a list, e.g. [2, 4, 6]")
        return value
    return value


def load_config(path: str | None, overrides: list[str]) -> DistillConfig:
    """A DistillConfig from a YAML preset plus ``key=value`` overrides; unknown keys are a clear error."""
    fields = {f.name: f for f in dataclasses.fields(DistillConfig)}
    raw: dict = {}
    if path is not None:
        loaded = read_yaml(path, "config file", "a YAML mapping of config keys to values (see configs/)")
        unknown = sorted(set(loaded) - set(fields))
        if unknown:
            raise SpdInputError(f"unknown config key(s) {unknown} in '{path}'; valid keys: {', '.join(fields)}")
        raw.update(loaded)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise SpdInputError(f"override '{item}' is not key=value")
        if key not in fields:
            raise SpdInputError(f"unknown config key '{key}'; valid keys: {', '.join(fields)}")
        raw[key] = text
    # A preset for a target that a data script prepared names its data beside the target
    # ("{target}/../data/train.jsonl"), so target=DIR/target alone moves both.
    target = str(raw.get("target") or DistillConfig.__dataclass_fields__["target"].default_factory())

    def beside(value):
        return (
            os.path.normpath(value.replace("{target}", target))
            if isinstance(value, str) and "{target}" in value
            else value
        )

    for key in ("data", "eval_data"):
        if key in raw:  # a key left out keeps its default; an explicit null stays null
            value = raw[key]
            if isinstance(value, list):
                raw[key] = [beside(v) for v in value]
            elif isinstance(value, dict):
                raw[key] = {name: beside(v) for name, v in value.items()}
            else:
                raw[key] = beside(value)
    values = {}
    for key, value in raw.items():
        try:
            values[key] = _coerce(value, str(fields[key].type))
        except (ValueError, TypeError) as exc:
            raise SpdInputError(f"bad value for {key}: {value!r} ({exc})") from None
    return DistillConfig(**values)
