"""Run configurations from TOML files and `--set key=value` overrides, and back to TOML: the
tables and keys of `training.config.RunConfig`, each value typed and checked by its field
(`core.checks.typed_value`); unknown or renamed keys raise naming the dotted key.

    cfg = load_config("configs/tiny.toml", overrides=["moe.top_k=1", "train.steps=50"])
    write_config(cfg, "runs/demo/config.toml")      # the resolved config, loadable again
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any

from moeflow.core.checks import did_you_mean, typed_value
from moeflow.layer import AXES
from moeflow.training.config import RENAMED_KEYS, RunConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

SECTIONS = tuple(f.name for f in dataclasses.fields(RunConfig))


def _section_types(section: str) -> dict[str, Any]:
    cls = {f.name: f.default_factory for f in dataclasses.fields(RunConfig)}[section]
    return typing.get_type_hints(cls)


def _is_table(annotation: Any) -> bool:
    return typing.get_origin(annotation) is dict


class ConfigErrors(ValueError):
    """Every problem of one configuration (file and `--set`), one line each, reported together."""

    def __init__(self, errors: list[Exception]) -> None:
        self.errors = list(errors)
        lines = "".join(f"\n  - {e}" for e in self.errors)
        super().__init__(f"{len(self.errors)} problems in the configuration:{lines}")


def _problem(problems: list[Exception], exc: Exception) -> None:
    problems.extend(exc.errors if isinstance(exc, ConfigErrors) else [exc])


def _raise(problems: list[Exception]) -> None:
    """One problem raises as itself (its type and message); several as `ConfigErrors`."""
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ConfigErrors(problems)


def config_from_dict(raw: dict[str, Any]) -> RunConfig:
    """Build a validated RunConfig from nested tables; every unknown table or key and every bad value
    is reported at once (`ConfigErrors`), each naming its dotted key."""
    problems: list[Exception] = []
    sections: dict[str, Any] = {}
    for section, table in raw.items():
        if section not in SECTIONS:
            hint = did_you_mean(section, SECTIONS)
            problems.append(ValueError(f"unknown config key {section!r}{hint} (sections: {', '.join(SECTIONS)})"))
            continue
        if not isinstance(table, dict):
            problems.append(TypeError(f"config key {section!r} must be a table, got {table!r}"))
            continue
        hints = _section_types(section)
        values = {}
        for key, value in table.items():
            try:
                _check_known(section, key, hints)
                if _is_table(hints[key]):
                    if not isinstance(value, dict):
                        raise TypeError(f"config key {section}.{key} must be a table, got {value!r}")
                    values[key] = dict(value)
                else:
                    values[key] = typed_value(f"{section}.{key}", value, hints[key], parse_text=False)
            except (ValueError, TypeError) as exc:
                _problem(problems, exc)
        if section == "moe":
            _check_axis_names(values, problems)
        sections[section] = values
    cls_of = {f.name: f.default_factory for f in dataclasses.fields(RunConfig)}
    built = {}
    for name in SECTIONS:  # each table on its own, so that one bad table does not hide another's problem
        try:
            built[name] = cls_of[name](**sections.get(name, {}))
        except (ValueError, TypeError) as exc:
            _problem(problems, exc)
    _raise(problems)
    return RunConfig(**built)


def _check_axis_names(values: dict[str, Any], problems: list[Exception]) -> None:
    """The MoE layer's axes (`moe.gate`, `moe.strategy`, ...) by name, checked on their own: an unknown
    name is reported (and left out) so that the table's other checks still run."""
    for axis, registry in AXES.items():
        name = values.get(axis)
        if isinstance(name, str) and name not in registry:
            hint = did_you_mean(name, registry.names())
            problems.append(ValueError(f"moe.{axis}={name!r}: unknown{hint}; valid: {registry.names()}"))
            del values[axis]
            values.pop(f"{axis}_options", None)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` strings to nested tables `raw` (a new dict is returned); every bad
    override is reported at once (`ConfigErrors`)."""
    merged = {section: dict(table) for section, table in raw.items()}
    problems: list[Exception] = []
    for item in overrides:
        try:
            _apply_one(merged, item)
        except (ValueError, TypeError) as exc:
            _problem(problems, exc)
    _raise(problems)
    return merged


def _apply_one(merged: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    key = key.strip()
    section, dot, name = key.partition(".")
    if not sep or not dot or not name:
        raise ValueError(f"--set expects section.key=value, got {item!r}")
    if section not in SECTIONS:
        raise ValueError(
            f"unknown config key {key!r}{did_you_mean(section, SECTIONS)} (sections: {', '.join(SECTIONS)})"
        )
    hints = _section_types(section)
    field_name, _, option = name.partition(".")
    _check_known(section, field_name if option else name, hints)
    if option:  # moe.balance_options.smoothing=0.3: typed by the component's options dataclass
        if not _is_table(hints[field_name]):
            raise ValueError(f"unknown config key {key!r} ({section}.{field_name} is not a table)")
        table = dict(merged.setdefault(section, {}).get(field_name, {}))
        table[option] = text.strip()
        merged[section][field_name] = table
    elif _is_table(hints[name]):
        raise ValueError(f"--set {key}: a table; set its keys, e.g. --set {key}.KEY=VALUE")
    else:
        merged.setdefault(section, {})[name] = typed_value(key, text.strip(), hints[name])


def _check_known(section: str, key: str, hints: dict[str, Any]) -> None:
    if key in hints:
        return
    moved = RENAMED_KEYS.get(f"{section}.{key}")
    if moved:
        raise ValueError(f"config key '{section}.{key}' is now {moved}")
    hint = did_you_mean(f"{section}.{key}", [f"{section}.{name}" for name in hints])
    raise ValueError(f"unknown config key '{section}.{key}'{hint}")


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {str(path)!r} is not valid TOML: {exc}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults, then the TOML file (if any), then the `--set` overrides, validated: the problems of
    the overrides and of the resulting tables are reported together (`ConfigErrors`)."""
    raw = read_toml(path) if path is not None else {}
    problems: list[Exception] = []
    good = []
    for item in overrides or []:
        try:
            _apply_one({}, item)
            good.append(item)
        except (ValueError, TypeError) as exc:
            problems.append(exc)
    try:
        cfg = config_from_dict(apply_overrides(raw, good))
    except (ValueError, TypeError) as exc:
        _problem(problems, exc)
    _raise(problems)
    return cfg


def config_to_dict(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Nested tables for TOML; `None` values are left out (TOML has no null, the default is None)."""
    return {
        section: {k: v for k, v in dataclasses.asdict(getattr(cfg, section)).items() if v is not None and v != {}}
        for section in SECTIONS
    }


def write_config(cfg: RunConfig, path: str | Path) -> None:
    import tomli_w

    Path(path).write_text(tomli_w.dumps(config_to_dict(cfg)))
