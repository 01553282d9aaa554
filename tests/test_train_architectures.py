"""`moeflow train` trains today's architectures (docs/architectures.md, "Training"): the shipped
DeepSeek-V3-like config natively, and Hugging Face models named by architecture and config
(random initialisation) or by a local `save_pretrained` directory — with the same strategies
(a copying one follows plain EP, and 2 processes follow 1), checkpoints (a 2-process run resumes
on 1) and metrics; bad `[model]` / `[moe]` combinations are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeflow import cli
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.training.generate import load_model

from .hf_models import ARCHS, COMMON

pytest.importorskip("transformers")

SMALL = [
    "model.d_model=32",
    "model.n_heads=2",
    "model.seq_len=32",
    "model.d_ff=64",
    "moe.d_hidden=16",
    "data.max_bytes=300000",
    "train.global_batch_size=8",
    "train.eval_every=6",
    "train.eval_batches=2",
    "train.checkpoint_every=6",
    "optim.warmup_steps=2",
]


def _sets(items):
    return [arg for item in items for arg in ("--set", item)]


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _train(run, *argv, steps=6):
    assert cli.main(["train", "--steps", str(steps), "--out", str(run), *argv]) == 0
    return _metrics(run)


def test_the_deepseek_v3_config_trains_natively(tmp_path):
    from moeflow.training.model import DenseFFN

    records = _train(tmp_path / "ds", "--config", "configs/deepseek_v3_tiny.toml", "--nproc", "1", *_sets(SMALL))
    assert records[-1]["loss"] < records[0]["loss"] - 0.3
    model, step = load_model(tmp_path / "ds")
    assert step == 6 and isinstance(model.blocks[0].ffn, DenseFFN)
    layer = model.moe_layers()[0][1]
    assert layer.num_experts == 16 and layer.top_k == 4 and layer.shared_experts is not None
    assert layer.gate.group_limit.n_group == 4 and layer.axes["balance"] == "aux_free"
    assert float(layer.balance.bias_E.abs().sum()) > 0, "the aux-free bias never moved"


@pytest.mark.multirank
def test_a_hugging_face_model_trains_with_moeflow_strategies_and_resumes(tmp_path):
    """DeepSeek-V3 (random init from its config) on 2 processes under shadowing (copies made) follows
    one process (balance weight 0: the loss is the global batch's; plain EP's equality with both is
    `multirank_hf`'s), a 2-process checkpoint resumes on 1 process and samples."""
    shrink = [
        f"model.hf_config.{k}={v}"
        for k, v in dict(
            hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, num_hidden_layers=3
        ).items()
    ]
    fast = tmp_path / "fast.json"
    CostModel(Topology([[0], [1]], [1e12, 1e12]), gemm_flops_per_s=1e6).save(fast)
    common = ["--config", "configs/hf_deepseek_v3_tiny.toml", *_sets([*shrink, "model.seq_len=32", *SMALL[5:]])]
    common += _sets(["moe.balance=gshard", "moe.balance_weight=0"])
    one = _train(tmp_path / "one", *common, "--nproc", "1")
    copies = ["--cost-model", str(fast), "--set", "moe.strategy=shadow"]
    shadow = _train(tmp_path / "shadow", *common, "--nproc", "2", *copies)
    assert [m["loss"] for m in shadow] == pytest.approx([m["loss"] for m in one], rel=1e-5, abs=1e-5)
    assert sum(sum(m["extra_copies_per_layer"]) for m in shadow) > 0, "the planner never shadowed"
    assert len(one[0]["expert_counts"]) == 2 and len(one[0]["expert_counts"][0]) == 8  # 2 MoE blocks, 8 experts
    assert one[-1]["loss"] < one[0]["loss"]
    with pytest.warns(UserWarning, match="describes 2 devices but this expert-parallel group has 1"):
        resumed = _train(tmp_path / "shadow", "--nproc", "1", "--resume", steps=8)
    assert [m["step"] for m in resumed] == list(range(1, 9))
    assert cli.main(["generate", "--run", str(tmp_path / "one"), "--length", "8", "--json"]) == 0


DSV3 = {
    **COMMON,
    "num_experts_per_tok": 2,
    **ARCHS["deepseek_v3"][2],
    "vocab_size": 256,
    "max_position_embeddings": 32,
    "output_router_logits": False,
    "tie_word_embeddings": False,
}
"""tests/hf_models.py's tiny DeepSeek-V3 (MLA, a dense first block, a shared expert, group-limited
routing) on byte tokens."""
HF_MESH = [
    "model.hf_architecture=DeepseekV3ForCausalLM",
    *(f"model.hf_config.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in DSV3.items()),
    "model.seq_len=32",
    *SMALL[5:],
    "moe.balance=gshard",
    "moe.balance_weight=0",
    "train.eval_every=0",
    "train.checkpoint_every=100",
]
MESH_RUNS = {
    "dense": ["parallel.dense=fsdp"],
    "experts": ["parallel.ep_size=1", "parallel.experts=fsdp"],
    "recompute": ["parallel.dense=fsdp", "train.activation_checkpointing=full"],
}


def _train_hf_mesh(rank, world, tmp):
    """A Hugging Face DeepSeek-V3 on 2 ranks: its decoder layers FSDP2 units, its experts FSDP2 over
    their data-parallel replicas, full recomputation (tests/multirank_train.py); and the units built."""
    from torch.distributed.fsdp import FSDPModule

    from moeflow.training.config_files import load_config
    from moeflow.training.trainer import Trainer

    from .multirank_train import runs, train_all

    train_all(rank, world, runs(tmp, {k: [*HF_MESH, *v, "train.steps=4"] for k, v in MESH_RUNS.items()}))
    both = load_config(None, [*HF_MESH, "parallel.dense=fsdp", *MESH_RUNS["experts"]])
    model = Trainer(both, Path(tmp) / "units").model
    assert all(isinstance(b, FSDPModule) for b in model.decoder_blocks()) and isinstance(model, FSDPModule)
    assert all(isinstance(layer, FSDPModule) for _, layer in model.moe_layers())


@pytest.mark.multirank
@pytest.mark.spawned(body=_train_hf_mesh, world=2, folder=True)
def test_a_hugging_face_model_on_the_mesh_follows_one_process(tmp_path, shared_spawns):
    one = _train(tmp_path / "one", "--nproc", "1", *_sets(HF_MESH), steps=4)
    trained = shared_spawns.run(_train_hf_mesh, 2)
    for name in MESH_RUNS:
        got = _metrics(trained / name)
        assert [m["step"] for m in got] == [1, 2, 3, 4], name
        assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in one], rel=1e-5, abs=1e-5), name
    # The sharded run's checkpoint resumes on one process where the one-process run goes on.
    more = _train(tmp_path / "one", "--nproc", "1", "--resume", steps=6)[4:]
    resumed = _train(trained / "dense", "--nproc", "1", "--resume", steps=6)[4:]
    assert [m["step"] for m in resumed] == [5, 6]
    assert [m["loss"] for m in resumed] == pytest.approx([m["loss"] for m in more], rel=1e-5, abs=1e-5)


def test_a_hugging_face_model_recomputes_its_decoder_layers(tmp_path):
    """`full`: transformers' gradient checkpointing of the decoder layers, the MoE layers replaying
    their routing: the same loss and gradients as without it, fewer activations kept."""
    from moeflow.training.config_files import load_config
    from moeflow.training.trainer import Trainer

    kept, grads, losses = {}, {}, {}
    for mode in ("none", "full"):
        trainer = Trainer(load_config(None, [*HF_MESH, f"train.activation_checkpointing={mode}"]), tmp_path / mode)
        sizes: list[int] = []

        def pack(t, sizes=sizes):
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            losses[mode] = trainer.train_step().loss
        kept[mode] = sum(sizes)
        grads[mode] = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        layers = trainer.model.decoder_blocks()
        assert all(layer.gradient_checkpointing == (mode == "full") for layer in layers), mode
    assert losses["full"] == losses["none"] and kept["full"] < kept["none"], (losses, kept)
    assert grads["full"].keys() == grads["none"].keys()
    for name, grad in grads["none"].items():
        torch.testing.assert_close(grads["full"][name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("arch", ["gpt_oss", "llama4", "glm4_moe"])
def test_hugging_face_models_train_from_a_pretrained_directory(tmp_path, arch):
    from .hf_models import tiny

    model = tiny(arch, vocab_size=256, output_router_logits=arch == "gpt_oss")
    model.save_pretrained(tmp_path / "pretrained")
    run = tmp_path / "run"
    sets = [f"model.hf_pretrained={tmp_path / 'pretrained'}", "model.seq_len=32", *SMALL[5:], "moe.balance=sequence"]
    records = _train(run, "--nproc", "1", *_sets(sets), steps=4)
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in records)
    assert records[-1]["loss"] < records[0]["loss"]
    if arch == "gpt_oss":  # the model's own load-balancing loss is part of the aux loss
        assert records[0]["aux_loss"] > 0.0


@pytest.mark.parametrize(
    ("sets", "named"),
    [
        (["model.hf_architecture=NoSuchForCausalLM"], "model.hf_architecture='NoSuchForCausalLM': not a transformers"),
        (["model.hf_architecture=LlamaForCausalLM"], "has no supported sparse-MoE block"),
        (["model.hf_config.hidden_size=32"], "model.hf_config needs model.hf_architecture"),
        (["model.hf_architecture=MixtralForCausalLM", "model.hf_config.vocab_size=64"], "vocab_size=64 cannot hold"),
        (["model.hf_architecture=MixtralForCausalLM", "moe.gate_options.normalize=false"], "moe.gate_options="),
        (["model.hf_architecture=MixtralForCausalLM", "moe.num_experts=8"], "moe.num_experts=8: model.hf_arch"),
        (["model.hf_architecture=MixtralForCausalLM", "train.grad_sync=fsmoe"], "train.grad_sync='fsmoe' prices"),
        (
            ["model.hf_architecture=MixtralForCausalLM", "train.activation_checkpointing=selective"],
            "train.activation_checkpointing='selective' with model.hf_architecture",
        ),
        (["model.hf_pretrained=/nonexistent"], "model.hf_pretrained='/nonexistent' has no config.json"),
        (["model.hf_architecture=MixtralForCausalLM", "model.hf_pretrained=/x"], "set one"),
    ],
)
def test_bad_hugging_face_settings_are_one_line_errors(tmp_path, capsys, sets, named):
    assert cli.main(["train", "--nproc", "1", "--steps", "1", "--out", str(tmp_path / "r"), *_sets(sets)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err
