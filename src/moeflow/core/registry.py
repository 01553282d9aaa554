"""Named components and their options: one mechanism for every axis of a MoE layer.

A MoE layer is configured along independent axes — `gate` and `balance` (routing), `strategy`
(where experts are materialized), `schedule` (order and overlap of communication and compute),
`dispatch` (how tokens travel). Each axis has one `Registry` of `Component`s, used unchanged by
`MoELayer`, the run configuration (`moe.*`), every CLI command and the simulator. A component is
chosen by name, or passed as an object; its options are a small dataclass of its own, filled from
a mapping (`MoELayer(balance="ta_moe", balance_options={"smoothing": 0.3})`, the config table
`[moe.balance_options]`, `--set moe.balance_options.smoothing=0.3`) and validated with errors that
name the key. Objects take no options (they are already configured).

    GATES.build("topk", ctx)                       # a module
    BALANCES.options("ta_moe", {"smoothing": 0.3}) # TAMoEOptions(smoothing=0.3, ...)
    PLANNERS.register(Component("hot", lambda ctx, opt: plan_hot, summary="..."))
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from moeflow.core.checks import did_you_mean, typed_value
from moeflow.core.expert_shape import ExpertShape


@dataclass(frozen=True)
class NoOptions:
    """The component takes no options."""


@dataclass(frozen=True)
class LayerContext:
    """What a component may need from its layer to be built by name."""

    num_experts: int
    """E, experts in the layer (global)."""
    top_k: int
    """k, experts chosen per token."""
    expert: ExpertShape
    """d_model, d_hidden and the expert kind."""
    cost_model: Any = None
    """`moeflow.perf.costmodel.CostModel` of the run's cluster, or None."""
    balance_weight: float = 0.0
    """Weight of the balance term (0: the balance term is off)."""
    capacity_factor: float | None = None
    """The layer's capacity factor (None: dropless); expert choice sizes its picks with it."""

    @property
    def d_model(self) -> int:
        return self.expert.d_model


@dataclass(frozen=True)
class Component:
    """One named entry of a registry."""

    name: str
    """The name users write (`gate="topk"`, `--set moe.strategy=shadow`)."""
    build: Callable[[LayerContext, Any], Any]
    """`build(context, options)` -> the component object."""
    options: type = NoOptions
    """Dataclass of the component's options (fields with defaults and docstrings)."""
    summary: str = ""
    """One line for `--help` and the docs."""
    needs_cost_model: bool = False
    """Whether building it requires `LayerContext.cost_model`."""
    kind: str = ""
    """A category within the axis that other axes check against (gates: the routing kind)."""


def parse_options(cls: type, raw: Any, where: str) -> Any:
    """An instance of the options dataclass `cls` from a mapping (or an instance, returned as is).
    Unknown keys and bad values raise errors naming `where` and the key."""
    if raw is None:
        raw = {}
    if isinstance(raw, cls):
        return raw
    if not isinstance(raw, Mapping):
        raise TypeError(f"{where}={raw!r}: expected a mapping of option names to values")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        valid = ", ".join(names) if names else "none (it takes no options)"
        raise ValueError(f"{where}: unknown option {unknown[0]!r}{did_you_mean(unknown[0], names)}; valid: {valid}")
    hints = typing.get_type_hints(cls)
    values = {key: typed_value(f"{where}.{key}", value, hints[key]) for key, value in raw.items()}
    try:
        return cls(**values)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{where}: {exc}") from None


class Registry:
    """The components of one axis, by name; see the module docstring."""

    def __init__(self, axis: str, components: list[Component], is_object: Callable[[Any], bool]) -> None:
        self.axis = axis
        self.is_object = is_object
        self._components: dict[str, Component] = {}
        for component in components:
            self.register(component)

    def register(self, component: Component) -> None:
        """Add (or replace) a component, making it available by name everywhere."""
        self._components[component.name] = component

    def names(self) -> list[str]:
        return list(self._components)

    def __contains__(self, name: object) -> bool:
        return name in self._components

    def __iter__(self) -> Iterator[str]:
        return iter(self._components)

    def get(self, name: Any) -> Component:
        if not isinstance(name, str) or name not in self._components:
            hint = did_you_mean(name, self.names())
            raise ValueError(f"unknown {self.axis}={name!r}{hint}; valid: {self.names()}")
        return self._components[name]

    def options(self, name: str, raw: Any = None, where: str | None = None) -> Any:
        """The validated options of component `name` (defaults for keys not given)."""
        component = self.get(name)
        return parse_options(component.options, raw, where or f"{self.axis}_options for {self.axis}={name!r}")

    def build(self, value: Any, ctx: LayerContext, raw_options: Any = None, where: str | None = None) -> Any:
        """`value` itself when it is an object of this axis, else the named component built from
        `ctx` and its options."""
        if self.is_object(value):
            if raw_options:
                raise ValueError(
                    f"{self.axis}_options={dict(raw_options)!r}: options apply to a {self.axis} chosen by "
                    f"name; configure the {type(value).__name__} object itself instead"
                )
            return value
        component = self.get(value)
        options = self.options(value, raw_options, where)
        if component.needs_cost_model and ctx.cost_model is None:
            raise ValueError(
                f"{self.axis}={value!r} needs a cost model (a topology preset or a `moeflow profile` JSON): "
                f"MoELayer(..., cost_model=CostModel...) or --cost-model (got cost_model=None)"
            )
        return component.build(ctx, options)

    def summaries(self) -> dict[str, str]:
        return {name: c.summary for name, c in self._components.items()}
