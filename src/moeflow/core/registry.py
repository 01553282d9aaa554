"""Build-by-name for the user-chosen components (gates, balance terms, strategies).

DESIGN.md §3.1: every component is chosen by a name from a registry, or passed as an object; an
unknown name is a `ValueError` naming the argument, the value and the valid names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

C = TypeVar("C")
T = TypeVar("T")


def build_named(
    argument: str, value: Any, registry: Mapping[str, Callable[[C], T]], ctx: C, is_object: Callable[[Any], bool]
) -> T:
    """`value` itself when `is_object(value)`, else `registry[value](ctx)`."""
    if is_object(value):
        return value
    if not isinstance(value, str) or value not in registry:
        raise ValueError(f"unknown {argument}={value!r}; valid: {sorted(registry)}")
    return registry[value](ctx)
