"""A config from defaults, a YAML file and `--set a.b=value` overrides; every
validation error as a `ConfigError` that names the field, the bad value and what is
allowed (with a suggestion for a misspelt key)."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from looprl.config.run import Config
from looprl.errors import ConfigError


class _YamlLoader(yaml.SafeLoader):
    """YAML 1.1 reads `5e-4` as a string; read it as the float everyone means (YAML 1.2)."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> object:
    return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 (a SafeLoader subclass)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults ← YAML file ← `a.b=value` overrides, validated into a `Config`."""
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_yaml(Path(path))
    for item in overrides or []:
        _apply_override(data, item)
    return config_from_dict(data)


def config_from_dict(data: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, data)) from None


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = parse_yaml(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    return data


def _apply_override(data: dict[str, Any], item: str) -> None:
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r} must look like section.field=value")
    try:
        value = parse_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def format_validation_error(err: ValidationError, data: dict[str, Any]) -> str:
    lines = ["invalid config:"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"  {path}: unknown key{_suggest(e['loc'])}")
            continue
        if not e["loc"]:  # a rule about several fields together
            lines.append(f"  {e['msg'].removeprefix('Value error, ')}")
            continue
        value = e.get("input")
        lines.append(f"  {path} = {value!r}: {e['msg']}{_allowed(e['loc'])}")
    return "\n".join(lines)


def _model_at(loc: tuple) -> tuple[type[BaseModel] | None, str | None]:
    """The section model that owns the field at `loc`, and the field's name."""
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        if isinstance(part, int):
            continue  # an item of a list of sections (eval.also): its section's fields
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None) if field else None
        if get_origin(ann) is list:
            ann = get_args(ann)[0]
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None, None
        model = ann
    return model, str(loc[-1])


def _suggest(loc: tuple) -> str:
    model, name = _model_at(loc)
    if model is None or name is None:
        return ""
    close = difflib.get_close_matches(name, list(model.model_fields), n=1)
    known = ", ".join(model.model_fields)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{hint}; known keys: {known}"


def _allowed(loc: tuple) -> str:
    while loc and isinstance(loc[-1], int):
        loc = loc[:-1]  # an item of a list field: describe the field
    model, name = _model_at(loc)
    field = model.model_fields.get(name) if model and name else None
    if field is None:
        return ""
    return f" [{name}: {field.description}]"


# ---------------------------------------------------------------- describing


def describe_fields(
    model: type[BaseModel] = Config, prefix: str = ""
) -> list[tuple[str, str, str]]:
    """(key, default, description) for every leaf field, in declaration order."""
    rows: list[tuple[str, str, str]] = []
    defaults = model()
    for name, field in model.model_fields.items():
        if field.exclude:
            continue  # a deprecated spelling, read but never written or listed
        key = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(describe_fields(ann, key + "."))
        else:
            rows.append((key, repr(getattr(defaults, name)), field.description or ""))
    return rows


def to_yaml(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
