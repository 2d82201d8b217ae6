"""A step graph's collectives name their process group by role, not by this process's group name.

Torch names a process group by a counter of the groups a process created (``"0"``, ``"5"``), so a
graph that carries those names depends on what ran before in the process (the groups the
rank-agreement check or another model made) and, with subgroups, on the rank. ``DataParallel.expand``
renames the group of every collective in the expanded graph (``name_groups_by_role``) to a
role name registered in c10d's group registry for the live group (``role_name``). Functional
collectives resolve the name when they run (eagerly, or in Inductor's code), so the graph stays the
same while the name resolves to this process's group.

The role name is a value: the group's size, the pattern of its ranks, each relative to its first
(``spmd_group:2:…`` for ranks [0, 1] and for ranks [2, 3] alike: the shard groups of a hybrid mesh
play one role on every rank), and the description its creator gave it (``default_pg``,
``mesh_shard``). Two live groups of one process with one pattern and description (two ``new_group``
calls over the same ranks) cannot share it: the second keeps its own name, as before, and a step
whose graph carries such a name is neither kept in the compile cache nor loaded from it.

Each collective also gets the name of the mesh dimension its group spans (``meta[MESH_DIM]``,
``mesh_dim_labels``): with tensor parallelism a step runs collectives over two or more dimensions of
one mesh ("dp" and "tp"), and the passes, ``spmd.explain`` and the ranks' agreement tell them apart by it.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Optional, Sequence

import torch.distributed as dist
import torch.fx as fx
from torch._C._distributed_c10d import _register_process_group, _unregister_process_group

from ..graph_utils import comm_group_name, is_comm_node
from ..graph_utils.meta import MESH_DIM
from ..graph_utils.nodes import set_comm_group_name

ROLE_PREFIX = "spmd_group:"


def group_role(group: dist.ProcessGroup) -> tuple[int, tuple[int, ...], str]:
    """What ``group`` is, the same on each of its ranks and on the ranks of a group in the same role:
    its size, its ranks each relative to its first, and the description its creator gave it."""
    ranks = dist.get_process_group_ranks(group)
    return len(ranks), tuple(r - ranks[0] for r in ranks), getattr(group, "group_desc", "")


def _role(group: dist.ProcessGroup) -> str:
    size, pattern, desc = group_role(group)
    return f"{ROLE_PREFIX}{size}:{hashlib.sha256(f'{pattern};{desc}'.encode()).hexdigest()[:16]}"


def release_role(group: dist.ProcessGroup) -> None:
    """Unregister ``group``'s role name where ``group`` holds it, so the next live group made in that role
    takes it (``role_name``); steps compiled on ``group`` must not run after (their collectives name the role)."""
    role = _role(group)
    with contextlib.suppress(Exception):  # never registered
        if dist.distributed_c10d._resolve_process_group(role) is group:
            _unregister_process_group(role)


def role_name(live_name: str) -> str:
    """The role name of the group registered as ``live_name``, registered for it; ``live_name`` itself
    where another live group of the process holds that role name, or where ``live_name`` names no group."""
    c10d = dist.distributed_c10d
    try:
        group = c10d._resolve_process_group(live_name)
    except Exception:  # not a registered group (a test's made-up name): nothing to rename
        return live_name
    role = _role(group)
    live = c10d._world.pg_names  # every group not destroyed -> its name
    try:
        holder = c10d._resolve_process_group(role)
    except Exception:  # never registered, or left by a destroyed group (which no longer resolves)
        holder = None
    if holder is not None and (holder is group or live.get(holder) == live.get(group)):
        return role
    if holder is not None and holder in live:
        return live_name  # another live group over the same pattern of ranks holds the role
    with contextlib.suppress(Exception):
        _unregister_process_group(role)  # left by a destroyed group
    _register_process_group(role, group)
    return role


def group_names_in(gm: fx.GraphModule) -> set[str]:
    """The process-group names the collectives of ``gm`` carry."""
    names = set()
    for node in gm.graph.nodes:
        if is_comm_node(node) and comm_group_name(node) is not None:
            names.add(comm_group_name(node))
    return names


def own_names(names: set[str]) -> list[str]:
    """Those of ``names`` (a graph's process-group names) that are not role names: this process's own
    names, kept where another live group of the process holds the role (``role_name``)."""
    return sorted(n for n in names if not n.startswith(ROLE_PREFIX))


def roles_resolve(names: set[str], groups: list) -> bool:
    """Register the role name of each of ``groups`` (the live groups a step uses: ``role_name``), then
    whether each of ``names`` (a loaded graph's, made in another process) is a role name that resolves to
    a group here. A process's own group name is never taken: in another process it may name another group."""
    if own_names(names):
        return False
    for group in groups:
        role_name(group.group_name)
    for name in names:
        try:
            dist.distributed_c10d._resolve_process_group(name)
        except Exception:  # no group of this process plays that role
            return False
    return True


def root_mesh(mesh):
    """The mesh ``mesh`` was sliced or concatenated from (itself for a mesh ``init_device_mesh`` made)."""
    return mesh._get_root_mesh()


def mesh_dim_labels(own_mesh, meshes: Sequence, own_group: Optional[dist.ProcessGroup] = None) -> dict[str, str]:
    """Live group name -> the name of the mesh dimension the group spans, for each dimension of the root
    meshes of ``own_mesh`` (the parallel mode's) and ``meshes`` (the DTensor parameters').

    A dimension is named as its root mesh names it; an unnamed one of the mode's own mesh "dp"
    (1-D) or "dp_replicate"/"dp_shard" (2-D), any other "dim{i}". ``own_group``: replicate's group,
    "dp" where no mesh names it.
    """
    labels: dict[str, str] = {}
    for k, mesh in enumerate(m for m in (own_mesh, *meshes) if m is not None):
        root = root_mesh(mesh)
        unnamed = (("dp",), ("dp_replicate", "dp_shard")) if k == 0 and own_mesh is not None else ()
        defaults = next((d for d in unnamed if len(d) == root.ndim), tuple(f"dim{i}" for i in range(root.ndim)))
        names = root.mesh_dim_names or defaults
        for i in range(root.ndim):
            labels.setdefault(root.get_group(i).group_name, names[i])
    if own_group is not None:
        labels.setdefault(own_group.group_name, "dp")
    return labels


def name_groups_by_role(gm: fx.GraphModule, dims: Optional[dict[str, str]] = None) -> None:
    """Rename the process group of every collective in ``gm`` to its ``role_name``, and label it with its
    mesh dimension (``meta[MESH_DIM]``) where ``dims`` (``mesh_dim_labels``) knows its group.

    Before: collectives carry this process's group names. After: each carries its group's role
    name, which resolves to the same group; nothing else changed.
    """
    renamed: dict[str, str] = {}
    for node in gm.graph.nodes:
        name = comm_group_name(node) if is_comm_node(node) else None
        if name is None:
            continue
        if dims and name in dims:
            node.meta[MESH_DIM] = dims[name]
        if name not in renamed:
            renamed[name] = role_name(name)
        set_comm_group_name(node, renamed[name])
    gm.recompile()
