"""Optional TensorBoard logging beside `metrics.jsonl` (`train.tensorboard = true`).

Rank 0 writes the scalars of every metrics record — losses, learning rate, gradient norm, tokens/s,
the routing's expert imbalance, the per-rank imbalance before and after placement, the copies — to
`DIR/tensorboard/` with `torch.utils.tensorboard.SummaryWriter`, which needs the `tensorboard`
package (`pip install 'moeflow[tensorboard]'`; checked before any process starts):

    tensorboard --logdir runs/default/tensorboard
"""

from __future__ import annotations

import importlib.util
import numbers
from pathlib import Path
from typing import Any

from moeflow.training.config import RunConfig

SCALARS = (
    "loss",
    "val_loss",
    "aux_loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "load_imbalance",
    "rank_load_imbalance_owners",
    "rank_load_imbalance",
    "copies",
    "cross_node_share",
)
"""The metrics record's keys written as scalars (tag = key)."""


def check_tensorboard(cfg: RunConfig) -> None:
    """Before processes start: `train.tensorboard = true` needs the tensorboard package."""
    if cfg.train.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ValueError(
            "train.tensorboard=true needs the tensorboard package: pip install 'moeflow[tensorboard]' "
            "(or pip install tensorboard)"
        )


class TensorBoardLog:
    """The scalars of each metrics record (module docstring)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def add(self, rec: dict[str, Any]) -> None:
        for key in SCALARS:
            value = rec.get(key)
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                self.writer.add_scalar(key, float(value), rec["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_tensorboard(cfg: RunConfig, out: Path) -> TensorBoardLog | None:
    """The run's TensorBoard log (`DIR/tensorboard/`), or None when `train.tensorboard` is off."""
    return TensorBoardLog(out / "tensorboard") if cfg.train.tensorboard else None
