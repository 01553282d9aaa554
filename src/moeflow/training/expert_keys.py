"""Checkpoint keys of expert tensors: one entry per GLOBAL expert id, of the FULL hidden size,
whatever the layout that saves or loads it.

A `[J, ...]` expert tensor (parameter or AdamW moment) is split into its J rows, keyed
`<name>.e<global id>`: each rank offers exactly the experts it holds, so a checkpoint written by one
expert-parallel group size loads into any other. Under `experts="fsdp"` a rank holds the rows of
its FSDP2 shard only (a DTensor over the dp replicas, `core.parallel.local_rows`): it offers those.
Under expert sharding (ESP, FSMoE §3,
`moeflow.core.expert_sharding`) a row is only this member's hidden slice (w1/w3 columns, b1, w2
rows): it is offered as this member's shard of a DTensor over the ESP group (`Shard(hidden axis)`,
the full size as its global shape). DCP then stores each slice as a chunk of the full tensor at its
offset, and a load reads, from however many chunks, exactly the part the loading rank holds: full
rows under plain EP, another slice under another `esp_size`. `b2` stays whole on every member:
a plain tensor, written once. Expert-DP replicas offer the same chunks; DCP writes each once.

Shape suffixes: J experts held, D d_model, H this member's hidden slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from moeflow.core.expert_sharding import hidden_axis
from moeflow.core.experts import GroupedExperts
from moeflow.core.parallel import local_rows


@dataclass
class ExpertRows:
    """How one `[J, ...]` expert parameter is keyed: global ids of its rows, and for a hidden slice
    the axis of a row that runs over the hidden dimension and the ESP group's mesh."""

    expert_ids: list[int]
    """Global id of every row of the LOCAL tensor (its FSDP2 shard's rows under `experts="fsdp"`)."""
    row_axis: int | None = None
    mesh: DeviceMesh | None = None


def expert_rows(model: nn.Module) -> dict[str, ExpertRows]:
    """Full parameter name -> `ExpertRows`, for every expert parameter of `model`."""
    out: dict[str, ExpertRows] = {}
    meshes: dict[int, DeviceMesh] = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, GroupedExperts):
            continue
        for pname, param in module.named_parameters(recurse=False):
            full_name = f"{module_name}.{pname}" if module_name else pname
            ids = [module.expert_ids[row] for row in local_rows(param)]
            axis = hidden_axis(module, pname)
            if axis is None:
                out[full_name] = ExpertRows(ids)
                continue
            group = getattr(module, "esp_group", None)
            if group is None:
                raise ValueError(
                    f"checkpoint: {full_name} is a hidden slice (esp_size={module.esp_size}) without its ESP "
                    f"group; shard with core.expert_sharding.to_expert_sharding(layer, group)"
                )
            if id(group) not in meshes:
                meshes[id(group)] = DeviceMesh.from_group(group, param.device.type)
            out[full_name] = ExpertRows(ids, axis - 1, meshes[id(group)])
    return out


def _full_slice(row: torch.Tensor, axis: int, mesh: DeviceMesh) -> DTensor:
    """`row` as this member's shard of the full tensor (a view: loading writes in place)."""
    shape = list(row.shape)
    shape[axis] *= mesh.size()
    full = torch.Size(shape)
    stride = torch.empty(full, device="meta").stride()
    return DTensor.from_local(row, mesh, [Shard(axis)], run_check=False, shape=full, stride=stride)


def split(prefix: str, tensor_J: torch.Tensor, rows: ExpertRows | None) -> dict[str, torch.Tensor]:
    """One entry for a dense tensor (`rows` None; a DTensor stays one, DCP reshards it); one per
    local expert row, keyed by global id."""
    if rows is None:
        return {prefix: tensor_J}
    if isinstance(tensor_J, DTensor):
        tensor_J = tensor_J.to_local()
    if rows.row_axis is None:
        return {f"{prefix}.e{e}": tensor_J[i] for i, e in enumerate(rows.expert_ids)}
    return {f"{prefix}.e{e}": _full_slice(tensor_J[i], rows.row_axis, rows.mesh) for i, e in enumerate(rows.expert_ids)}
