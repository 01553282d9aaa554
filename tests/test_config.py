"""Config dataclasses, TOML loading, --set overrides, round trip through the resolved config.toml."""

from __future__ import annotations

import pytest

from moeflow.training.config import ModelConfig, MoEConfig, RunConfig, TrainConfig
from moeflow.training.config_files import apply_overrides, config_from_dict, load_config, write_config


def test_defaults_and_repo_configs_load():
    assert load_config() == RunConfig()
    tiny = load_config("configs/tiny.toml")
    assert tiny.moe.num_experts == 4 and tiny.train.steps == 200
    small = load_config("configs/small.toml")
    assert small.model.d_model > tiny.model.d_model
    # The shipped configs leave the balance term to the gate: any gate works with one --set.
    assert tiny.moe.balance == "gshard"
    for gate in ("expert_choice", "soft"):
        assert load_config("configs/tiny.toml", [f"moe.gate={gate}"]).moe.balance == "none"


def test_overrides_are_coerced_by_field_type():
    cfg = load_config(
        "configs/tiny.toml",
        ["moe.top_k=1", "optim.lr=1e-3", "train.record_routing=true", "moe.capacity_factor=1.25", "data.path=some/dir"],
    )
    assert cfg.moe.top_k == 1 and isinstance(cfg.moe.top_k, int)
    assert cfg.optim.lr == 1e-3
    assert cfg.train.record_routing is True
    assert cfg.moe.capacity_factor == 1.25
    assert cfg.data.path == "some/dir"
    assert load_config(None, ["moe.capacity_factor=none"]).moe.capacity_factor is None
    assert load_config(None, ["train.record_routing=off"]).train.record_routing is False


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("moe.bogus=1", "moe.bogus"),
        ("nosection.x=1", "nosection.x"),
        ("train.steps=abc", "train.steps"),
        ("train.record_routing=maybe", "train.record_routing"),
        ("steps=5", "steps=5"),
        ("model.n_heads=3", "n_heads"),
        ("moe.top_k=9", "moe.top_k"),
        ("train.precision=fp8", "train.precision"),
        ("data.val_fraction=1.5", "data.val_fraction"),
        ("optim.min_lr=1.0", "optim.min_lr"),
    ],
)
def test_bad_overrides_name_the_key(override, named):
    with pytest.raises((ValueError, TypeError), match=named.replace(".", r"\.")):
        load_config("configs/tiny.toml", [override])


def test_unknown_toml_key_and_wrong_type_are_named(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[moe]\nnum_experts = 4\nexperts_per_token = 2\n")
    with pytest.raises(ValueError, match="'moe.experts_per_token'"):
        load_config(bad)
    bad.write_text("[train]\nsteps = 'many'\n")
    with pytest.raises(TypeError, match="train.steps"):
        load_config(bad)
    bad.write_text("[optimizer]\nlr = 1\n")
    with pytest.raises(ValueError, match="optimizer"):
        load_config(bad)
    with pytest.raises(FileNotFoundError, match="missing.toml"):
        load_config(tmp_path / "missing.toml")


def test_ints_are_accepted_for_float_fields():
    cfg = config_from_dict({"optim": {"lr": 1, "min_lr": 0}})
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config("configs/tiny.toml", ["moe.capacity_factor=2.0", "train.seed=7"])
    write_config(cfg, tmp_path / "config.toml")
    assert load_config(tmp_path / "config.toml") == cfg
    # None is written by leaving the key out; it loads back as the default None.
    write_config(RunConfig(), tmp_path / "default.toml")
    assert load_config(tmp_path / "default.toml") == RunConfig()


def test_cross_field_validation():
    with pytest.raises(ValueError, match="n_heads=3"):
        ModelConfig(d_model=64, n_heads=3)
    with pytest.raises(ValueError, match="top_k=5"):
        MoEConfig(num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="train.on_nonfinite"):
        TrainConfig(on_nonfinite="ignore")
    cfg = RunConfig()
    cfg.validate_world_size(cfg.moe.num_experts)
    with pytest.raises(ValueError, match="num_experts=4"):
        cfg.validate_world_size(3)


def test_apply_overrides_does_not_mutate_input():
    raw = {"moe": {"top_k": 2}}
    merged = apply_overrides(raw, ["moe.top_k=1"])
    assert raw == {"moe": {"top_k": 2}} and merged == {"moe": {"top_k": 1}}


def test_component_options_tables_from_toml_and_set_validated_against_the_component(tmp_path):
    """One mechanism for every component's options: `[moe.<axis>_options]` in TOML or
    `--set moe.<axis>_options.<key>=...`, typed and checked by the chosen component's dataclass."""
    path = tmp_path / "opts.toml"
    path.write_text(
        '[moe]\nstrategy = "shadow"\nschedule = "pairwise"\n[moe.strategy_options]\nmin_gain = 0.1\n'
        "[moe.schedule_options]\ngroup_size = 2\n"
    )
    cfg = load_config(path, ["moe.strategy_options.search=greedy", "moe.schedule_options.group_size=1"])
    assert cfg.moe.strategy_options == {"min_gain": 0.1, "search": "greedy"}
    assert cfg.moe.schedule_options == {"group_size": 1} and isinstance(cfg.moe.schedule_options["group_size"], int)
    assert cfg.moe.layer_options()["strategy_options"] == {"min_gain": 0.1, "search": "greedy"}
    write_config(cfg, tmp_path / "resolved.toml")
    assert load_config(tmp_path / "resolved.toml") == cfg
    cfg = load_config(
        None, ["moe.balance=ta_moe", "moe.balance_options.smoothing=0.3", "moe.balance_options.steer_rate=0"]
    )
    assert cfg.moe.balance_options == {"smoothing": 0.3, "steer_rate": 0.0}
    bad = [
        (["moe.balance=ta_moe", "moe.balance_options.smothing=0.3"], r"moe.balance_options: unknown option 'smothing'"),
        (["moe.balance=ta_moe", "moe.balance_options.smoothing=2"], r"moe.balance_options: smoothing=2.0"),
        (["moe.schedule=pairwise", "moe.schedule_options.group_size=0"], r"moe.schedule_options: group_size=0"),
        (["moe.schedule_options.group_size=2"], r"moe.schedule_options: unknown option 'group_size'; valid: none"),
        (["moe.strategy=shadow", "moe.strategy_options.search=best"], r"moe.strategy_options.search='best'"),
        (["moe.strategy=ta_moe"], r"moe.strategy='ta_moe': unknown; valid: \['ep', 'shadow'"),
        (["moe.group_size=2"], r"'moe.group_size' is now moe.schedule_options.group_size"),
        (["moe.ta_moe_smoothing=0.2"], r"'moe.ta_moe_smoothing' is now moe.balance_options.smoothing"),
        (["moe.schedule_options=2"], r"--set moe.schedule_options: a table"),
        (["moe.top_k.x=2"], r"moe.top_k is not a table"),
    ]
    for overrides, message in bad:
        with pytest.raises(ValueError, match=message):
            load_config(None, overrides)


def test_copy_chunks_reach_the_layer_and_the_cost_model_its_planners_price_with():
    """`moe.copy_chunks` (Hecate §4.1's chunk pipeline): a `--set` override, checked in one line,
    handed to every MoE layer and to the cost model its planner prices the copy trees with."""
    from moeflow.perf.costmodel import CostModel
    from moeflow.perf.topology import Topology
    from moeflow.training.model import build_moe_layer

    assert load_config("configs/tiny.toml", []).moe.copy_chunks == 1
    cfg = load_config("configs/tiny.toml", ["moe.copy_chunks=4", "moe.strategy=fssdp"])
    assert cfg.moe.copy_chunks == 4
    cm = CostModel(Topology.from_spec([[0, 1], [2, 3]], [1e9, 1e10]), 1e12)
    layer = build_moe_layer(16, cfg.moe, cm)
    assert layer.copy_chunks == 4 and layer.cost_model.copy_chunks == 4 and cm.copy_chunks == 1
    for bad in ("0", "-2"):
        with pytest.raises(ValueError, match=rf"^moe\.copy_chunks must be an integer >= 1, got {bad}$"):
            load_config("configs/tiny.toml", [f"moe.copy_chunks={bad}"])
    for bad in ("2.5", "true"):
        with pytest.raises((ValueError, TypeError), match=r"moe\.copy_chunks"):
            load_config("configs/tiny.toml", [f"moe.copy_chunks={bad}"])
