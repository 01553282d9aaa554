"""Validation of user input, in one place: every error names the argument and its value.

    positive_int("num_experts", 0)        # ValueError: num_experts=0 must be a positive int
    typed_value("moe.top_k", "2", int)    # 2 (text from `--set` parsed by the field's type)

`typed_value` is shared by the run configuration (TOML tables, `--set key=value`) and by the
options of every named component (`MoELayer(balance_options=...)`), so both accept and reject
the same values with the same messages.
"""

from __future__ import annotations

import difflib
import math
import types
import typing
from typing import Any, Literal

import numpy as np
import torch


def positive_int(name: str, value: Any, minimum: int = 1) -> int:
    """`value` as an int >= `minimum` (default 1); bools and non-integers are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}={value!r} must be an int")
    if value < minimum:
        bound = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name}={value!r} must be {bound}")
    return int(value)


def did_you_mean(word: Any, candidates: Any) -> str:
    """`" (did you mean 'shadow'?)"` for the closest of `candidates` to a misspelt `word`; "" when none
    is close (difflib's ratio >= 0.6)."""
    close = difflib.get_close_matches(str(word), [str(c) for c in candidates], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_layer_input(x: Any, d_model: int, check_finite: bool) -> None:
    """A `MoELayer` input: a floating-point tensor whose last dimension is `d_model` (finite, with
    `check_finite`)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"MoELayer input must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"MoELayer input dtype={x.dtype} must be floating point")
    if x.dim() == 0 or x.shape[-1] != d_model:
        raise ValueError(f"MoELayer input shape {tuple(x.shape)}: last dim must be d_model={d_model}")
    if check_finite and not torch.isfinite(x).all():
        raise ValueError("MoELayer input contains NaN or Inf (check_finite=True)")


def finite_number(
    name: str, value: Any, low: float = -math.inf, high: float = math.inf, low_open: bool = False
) -> float:
    """`value` as a finite float in [low, high] (or (low, high] with `low_open`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}={value!r} must be a number")
    v = float(value)
    low_ok = v > low if low_open else v >= low
    if not (math.isfinite(v) and low_ok and v <= high):
        lo = "(" if low_open else "["
        raise ValueError(f"{name}={value!r} must be a finite number in {lo}{low:g}, {high:g}]")
    return v


def _alternatives(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _parse_text(key: str, text: str, kind: Any) -> Any:
    if typing.get_origin(kind) is Literal:
        if text not in typing.get_args(kind):
            raise ValueError(f"{key}={text!r}: expected one of {list(typing.get_args(kind))}")
        return text
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ValueError
    if kind is int:
        return int(text)
    if kind is float:
        return float(text)
    if kind is str:
        return text
    raise TypeError(f"{key}: unsupported field type {kind!r}")


def typed_value(key: str, value: Any, annotation: Any, parse_text: bool = True) -> Any:
    """Check `value` against a field type (`int`, `float`, `bool`, `str`, a `Literal`, or an
    Optional of those). With `parse_text`, text (from `--set key=value`) is parsed by that type,
    `none` meaning None where None is allowed (a TOML file has typed values: pass False); ints are
    accepted for floats. Errors name `key` and the value."""
    allowed = _alternatives(annotation)
    if value is None and type(None) in allowed:
        return None
    kinds = [k for k in allowed if k is not type(None)]
    if isinstance(value, str) and parse_text:
        if type(None) in allowed and value.strip().lower() in ("none", "null", ""):
            return None
        if str in kinds or any(typing.get_origin(k) is Literal and value in typing.get_args(k) for k in kinds):
            return value
        for kind in kinds:
            try:
                return _parse_text(key, value, kind)
            except ValueError:
                continue
        names = " or ".join(getattr(k, "__name__", str(k)) for k in kinds)
        raise ValueError(f"{key}={value!r}: not a valid {names}")
    for kind in kinds:
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is bool and isinstance(value, bool):
            return value
        if kind in (int, str) and isinstance(value, kind) and not isinstance(value, bool):
            return value
    names = " or ".join(getattr(k, "__name__", str(k)) for k in allowed)
    raise TypeError(f"{key} must be {names}, got {value!r}")
