"""moeflow: Mixture-of-Experts training across many devices, for skewed loads and uneven networks."""

from moeflow.gates import Routing
from moeflow.hooks import MoEHook
from moeflow.layer import MoELayer, MoEStats
from moeflow.placement import Placement

__all__ = ["MoEHook", "MoELayer", "MoEStats", "Placement", "Routing"]
__version__ = "0.1.0"
