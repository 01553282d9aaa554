"""moeflow: Mixture-of-Experts training across many devices, for skewed loads and uneven networks."""

from moeflow.core.hooks import MoEHook
from moeflow.core.layer import MoELayer, MoEStats
from moeflow.core.placement import Placement
from moeflow.routing.gates import Routing

__all__ = ["MoEHook", "MoELayer", "MoEStats", "Placement", "Routing"]
__version__ = "0.1.0"
