"""What the run's strategy did, in words: the progress bar's fields and the end-of-run summary.

The routing's imbalance (`load_imbalance`: max/mean tokens per *expert*) is the same under every
strategy; what a strategy changes is the load of each *rank* after its placement (copies of hot
experts take tokens off their owner). Both are shown side by side: the per-rank max/mean with every
expert on its owner only (plain EP's load) and after the placement that ran.

    tally = StrategyTally(cfg.moe.strategy, cfg.moe.schedule)
    tally.add(record)                      # each metrics.jsonl record
    bar.set_postfix_str(bar_fields(record, cfg.moe.strategy))
    summary["strategy"] = tally.summary()
"""

from __future__ import annotations

from collections import Counter
from typing import Any


def bar_fields(rec: dict[str, Any], strategy: str) -> str:
    """`loss=2.443 tok/s=10,809 imb=1.17 ranks=1.31→1.02 copies=2`: the routing's expert imbalance,
    then the per-rank imbalance before → after placement, and the copies (when the strategy made any);
    for `strategy="auto"` the planner it chose most this step."""
    loss = "nan" if rec["loss"] is None else f"{rec['loss']:.3f}"  # a skipped step's non-finite loss is null
    text = f"loss={loss} tok/s={rec['tokens_per_s']:,.0f} imb={rec['load_imbalance']:.2f}"
    if "rank_load_imbalance" in rec:
        text += f" ranks={rec['rank_load_imbalance_owners']:.2f}→{rec['rank_load_imbalance']:.2f}"
        if rec.get("copies"):
            text += f" copies={rec['copies']}"
        chosen = Counter(rec.get("strategy_per_layer") or []).most_common(1)
        if chosen and strategy == "auto":
            text += f" auto→{chosen[0][0]}"
    return text


class StrategyTally:
    """Running totals over the logged steps of a run (rank 0), for the summary."""

    def __init__(self, strategy: str, schedule: str) -> None:
        self.strategy, self.schedule = strategy, schedule
        self.steps = 0
        self.copies = 0
        self.before = self.after = 0.0
        self.chosen_strategies: Counter[str] = Counter()
        self.chosen_schedules: Counter[str] = Counter()

    def add(self, rec: dict[str, Any]) -> None:
        if "rank_load_imbalance" not in rec:
            return
        self.steps += 1
        self.copies += rec.get("copies") or 0
        self.before += rec["rank_load_imbalance_owners"]
        self.after += rec["rank_load_imbalance"]
        self.chosen_strategies.update(rec.get("strategy_per_layer") or [])
        self.chosen_schedules.update(rec.get("schedule_per_layer") or [])

    def summary(self) -> dict[str, Any]:
        """JSON-able totals: strategy, schedule, copies per step, per-rank imbalance before/after
        placement (means over logged steps and layers), and what `auto` chose (shares of layer-steps)."""
        n = max(self.steps, 1)
        out: dict[str, Any] = {
            "strategy": self.strategy,
            "schedule": self.schedule,
            "logged_steps": self.steps,
            "copies_per_step": self.copies / n,
            "rank_load_imbalance_owners": self.before / n,
            "rank_load_imbalance": self.after / n,
        }
        for key, counts, configured in (
            ("strategy_chosen", self.chosen_strategies, self.strategy),
            ("schedule_chosen", self.chosen_schedules, self.schedule),
        ):
            total = sum(counts.values())
            if total and (configured == "auto" or len(counts) > 1):
                out[key] = {name: c / total for name, c in counts.most_common()}
        return out


def format_strategy(s: dict[str, Any]) -> list[str]:
    """The summary's lines about the strategy (`StrategyTally.summary`)."""
    if not s.get("logged_steps"):
        return []
    strategy, schedule = s["strategy"], s["schedule"]
    for key, name in (("strategy_chosen", "strategy"), ("schedule_chosen", "schedule")):
        if key in s:
            shares = ", ".join(f"{k} {v:.0%}" for k, v in s[key].items())
            chosen = f"{s[name]} (chose {shares} of layer-steps)"
            strategy, schedule = (chosen, schedule) if name == "strategy" else (strategy, chosen)
    return [
        f"strategy {strategy}, schedule {schedule}: {s['copies_per_step']:.1f} expert copies per step; "
        f"per-rank load max/mean {s['rank_load_imbalance_owners']:.2f} with owners only -> "
        f"{s['rank_load_imbalance']:.2f} after placement (mean over steps and layers)"
    ]
