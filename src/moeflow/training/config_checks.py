"""Checks shared by the run configuration's tables (`training.config`, `training.train_config`):
each raises a one-line error naming the dotted key and its value."""

from __future__ import annotations

import sys
from typing import Any

from moeflow.core.checks import did_you_mean

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib


def check_positive(section: str, **values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{section}.{name} must be > 0, got {value!r}")


def toml_value(value: Any) -> Any:
    """A text value as the TOML value it spells (`64`, `1e-5`, `true`, `[0, 1]`), else unchanged."""
    if not isinstance(value, str):
        return value
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value


def check_choice(section: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(
            f"{section}.{name} must be one of {', '.join(allowed)}; got {value!r}{did_you_mean(value, allowed)}"
        )


def check_int_at_least(where: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where} must be an integer >= {minimum}, got {value!r}")
