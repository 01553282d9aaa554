"""DeepSeek's expert-parallel load balancer (EPLB, github.com/deepseek-ai/EPLB, `rebalance_experts`)
re-implemented in PyTorch from its published description, as the baseline of
`benchmarks/planner_overhead.py --scale`. No package on PyPI ships it (`pip index versions eplb`
and `deepseek-eplb` find nothing; 2026-11-26), so this file restates the algorithm:

- **Replication**: `num_replicas − E` redundant slots, each given to the logical expert with the
  largest load per replica so far (`replicate`).
- **Balanced packing**: items by descending weight, each into the lightest pack that still has
  room, every pack taking the same number of items (`balanced_packing`).
- **Hierarchical policy** (expert groups divisible by the nodes): pack the expert groups onto the
  nodes, replicate within each node, pack each node's replicas onto its GPUs. **Global policy**
  (otherwise): one group, one node — replicate globally, pack onto the GPUs.

Returns the published three maps: `phy2log [layers, num_replicas]` (the logical expert of every
physical slot, slot s on GPU s // (num_replicas / num_gpus)), `log2phy [layers, E, max replicas]`
(-1 padded) and `logcnt [layers, E]`. Unlike moeflow's `strategy="eplb"` (which keeps every expert's
owner and prices its copies), this is the inference-time layout as published: every slot is a
permanent replica, experts move freely between GPUs, nothing is priced.

Shape suffixes: X rows (layers, or layers × nodes), E logical experts, L layers; `item_weight`
`[rows, items]` (items: experts or groups of them), packs and replicas have no letter.
"""

from __future__ import annotations

import torch


def balanced_packing(item_weight: torch.Tensor, packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's items into `packs` packs of items / packs items each, heaviest item first into the
    lightest pack with room (ties: the lower pack) → (pack of each item, its place in the pack)."""
    rows, items = item_weight.shape
    if items % packs:
        raise ValueError(f"{items} items do not fill {packs} packs equally")
    per_pack = items // packs
    if per_pack == 1:
        index = torch.arange(items).expand(rows, items).clone()
        return index, torch.zeros(rows, items, dtype=torch.int64)
    pack_of = torch.full((rows, items), -1, dtype=torch.int64)
    place = torch.full((rows, items), -1, dtype=torch.int64)
    order = item_weight.float().argsort(dim=-1, descending=True, stable=True)
    for x in range(rows):
        load = [0.0] * packs
        count = [0] * packs
        for item in order[x].tolist():
            pack = min((p for p in range(packs) if count[p] < per_pack), key=lambda p: (load[p], p))
            pack_of[x, item], place[x, item] = pack, count[pack]
            load[pack] += float(item_weight[x, item])
            count[pack] += 1
    return pack_of, place


def replicate(weight_XE: torch.Tensor, replicas: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`replicas` physical slots for the E logical experts of every row: slot i < E is expert i, each
    further slot the expert with the largest load per replica so far → (logical expert of every
    slot, its replica number, replicas per expert)."""
    rows, experts = weight_XE.shape
    if replicas < experts:
        raise ValueError(f"replicas={replicas}: fewer than the {experts} experts")
    phy2log = torch.arange(replicas, dtype=torch.int64).repeat(rows, 1)
    rank = torch.zeros(rows, replicas, dtype=torch.int64)
    count = torch.ones(rows, experts, dtype=torch.int64)
    every = torch.arange(rows)
    for slot in range(experts, replicas):
        chosen = (weight_XE / count).argmax(dim=-1)
        phy2log[:, slot] = chosen
        rank[:, slot] = count[every, chosen]
        count[every, chosen] += 1
    return phy2log, rank, count


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(perm)
    inverse.scatter_(1, perm, torch.arange(perm.size(1)).expand(perm.shape).contiguous())
    return inverse


def _hierarchical(weight_LE: torch.Tensor, replicas: int, groups: int, nodes: int, gpus: int):
    layers, experts = weight_LE.shape
    group_size, groups_per_node = experts // groups, groups // nodes
    slots_per_gpu = replicas // gpus
    # 1. Expert groups onto nodes, balanced; experts renumbered node by node ("mlog").
    group_pack, group_place = balanced_packing(weight_LE.unflatten(-1, (groups, group_size)).sum(-1), nodes)
    log2mlog = ((group_pack * groups_per_node + group_place) * group_size).unsqueeze(-1) + torch.arange(group_size)
    log2mlog = log2mlog.flatten(-2)
    mlog2log = _inverse(log2mlog)
    # 2. Replicate within every node.
    node_weight = weight_LE.gather(-1, mlog2log).view(-1, experts // nodes)
    phy2mlog, phy_rank, mlog_count = replicate(node_weight, replicas // nodes)
    # 3. Every node's replicas onto its GPUs, balanced by load per replica.
    phy_weight = (node_weight / mlog_count).gather(-1, phy2mlog)
    pack, place = balanced_packing(phy_weight, gpus // nodes)
    phy2slot = pack * slots_per_gpu + place
    slot2phy = _inverse(phy2slot)
    slot2mlog = phy2mlog.gather(-1, slot2phy).view(layers, nodes, -1)
    slot2mlog = (slot2mlog + torch.arange(0, experts, experts // nodes).view(1, -1, 1)).flatten(-2)
    slot2log = mlog2log.gather(-1, slot2mlog)
    slot_rank = phy_rank.gather(-1, slot2phy).view(layers, -1)
    log_count = mlog_count.view(layers, -1).gather(-1, log2mlog)
    return slot2log, slot_rank, log_count


def rebalance_experts(
    weight_LE: torch.Tensor, replicas: int, groups: int, nodes: int, gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek EPLB's entry point (module docstring): hierarchical when the expert groups divide
    evenly over the nodes, else global → (phy2log, log2phy, logcnt)."""
    layers, experts = weight_LE.shape
    weight = weight_LE.float().cpu()
    if experts % groups or replicas % gpus or gpus % nodes:
        raise ValueError(f"EPLB: {experts} experts, {groups} groups, {replicas} replicas, {gpus} GPUs, {nodes} nodes")
    if groups % nodes == 0:
        phy2log, rank, count = _hierarchical(weight, replicas, groups, nodes, gpus)
    else:
        phy2log, rank, count = _hierarchical(weight, replicas, 1, 1, gpus)
    most = int(count.max())
    log2phy = torch.full((layers, experts, most), -1, dtype=torch.int64)
    log2phy.view(layers, -1).scatter_(-1, phy2log * most + rank, torch.arange(replicas).expand(layers, -1).contiguous())
    return phy2log, log2phy, count


def gpu_loads(weight_LE: torch.Tensor, phy2log: torch.Tensor, count: torch.Tensor, gpus: int) -> torch.Tensor:
    """Load on every GPU `[layers, gpus]` when each expert's load is split evenly over its replicas."""
    per_replica = (weight_LE.float() / count).gather(-1, phy2log)
    return per_replica.view(weight_LE.shape[0], gpus, -1).sum(-1)
