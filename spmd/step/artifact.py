"""A compiled step as data (``StepArtifact``): what another process needs to run it without tracing.

The transform stage's result is stored: the logical graph after the passes and the moves made on
it, the expanded graph (what the ranks compare before a call), how the step's inputs and outputs
map onto the graph (the output tree, the gradients taken and left, the DTensor outputs) and the
``Lowering`` its graphs get. Loading rebuilds a ``CompiledStep`` that the lower stage then compiles
as usual, where Inductor's own cache (``spmd.lower.fx_cache``) finds the code it made before.

Nothing in an artifact is process state: graphs are ``graph_utils.graph_record`` records, a DTensor's
mesh is named by a parameter that lives on it (rebuilt from the live parameter), and the parallel
mode that expanded the graph is the live one; collectives name their groups by role
(``spmd.parallel.group_roles``), resolved to this process's groups on load; a step whose collectives
keep this process's own group names (another live group holds the role) is not kept. A loaded artifact is
checked against the live state (the graph's inputs by name, in order, and a group for each role)
and refused, as a miss, where they differ.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..graph_utils.graph_record import GraphRecord, UnrecordableGraph, load_graph, record_graph
from ..graph_utils.meta import NAME
from ..lower.lowering import Lowering
from ..parallel.data_parallel import PARALLEL_MODE
from ..parallel.group_roles import group_names_in, own_names, roles_resolve
from ..trace.accumulation import GradPlan
from ..trace.step_state import StepState
from .compiled_step import CompiledStep
from .iter_graph_module import IterGraphModule

FORMAT = 1  # bumped when what an artifact holds changes


@dataclass
class SpecRecord:
    """A DTensor spec as values: the parameter whose mesh it lives on, its placements and tensor metadata."""

    mesh_of_param: int
    placements: tuple
    shape: tuple
    stride: tuple
    dtype: torch.dtype


@dataclass
class StepArtifact:
    """A compiled step's transform-stage result as plain data (see the module docstring)."""

    logical: GraphRecord
    moves: list[tuple[list[str], str]]
    expanded: GraphRecord
    input_names: list[Optional[str]]
    out_spec: str
    grads: dict
    dtensors: dict[int, SpecRecord]
    lowering: Optional[Lowering]
    live: dict[int, int] = field(default_factory=dict)  # output position -> the state's tensor it returns
    format: int = FORMAT
    extra: dict = field(default_factory=dict)  # what the caller keeps beside it (key description, guards)


def _spec_record(spec: Any, state: StepState) -> Optional[SpecRecord]:
    if spec is None:
        return None
    owner = next((i for i, p in enumerate(state.params)
                  if getattr(getattr(p, "_spec", None), "mesh", None) is spec.mesh), None)
    if owner is None:
        raise UnrecordableGraph("a DTensor output lives on a mesh no parameter of the step lives on")
    meta = spec.tensor_meta
    return SpecRecord(owner, tuple(spec.placements), tuple(meta.shape), tuple(meta.stride), meta.dtype)


def _spec(record: Optional[SpecRecord], state: StepState) -> Any:
    if record is None:
        return None
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    mesh = state.params[record.mesh_of_param]._spec.mesh
    return DTensorSpec(mesh, record.placements, TensorMeta(torch.Size(record.shape), record.stride, record.dtype))


def _input_names(gm: fx.GraphModule) -> list[Optional[str]]:
    return [n.meta.get(NAME) for n in gm.graph.nodes if n.op == "placeholder"]


def _groups_of(state: StepState, parallel_mode: Any) -> list:
    """The live process groups the step's collectives may use: the mode's, and each mesh dimension's
    of the DTensor parameters (a sharded mode's, and what user code reduces over, e.g. clipping)."""
    groups = [parallel_mode.process_group()]
    for p in state.params:
        mesh = getattr(getattr(p, "_spec", None), "mesh", None)
        if mesh is not None:
            groups += [mesh.get_group(d) for d in range(mesh.ndim)]
    unique = {id(g): g for g in groups if g is not None}
    return list(unique.values())


def artifact_of(entry: CompiledStep, state: StepState) -> StepArtifact:
    """``entry`` (a step our transformation made: an ``IterGraphModule``) as a ``StepArtifact``;
    ``UnrecordableGraph`` for a step that cannot be kept (a custom runner, an opaque graph value)."""
    runner = entry.runner
    if not isinstance(runner, IterGraphModule):
        raise UnrecordableGraph(f"the step runs a {type(runner).__name__}, not an IterGraphModule")
    own = own_names(group_names_in(runner.logical_gm))
    if own:
        raise UnrecordableGraph(
            f"its collectives name process groups {own} by this process's own names, which another process may "
            "give to other groups: another live group over the same ranks holds their role (two device meshes or "
            "new_group calls over the same ranks). To keep the step, destroy the group no longer used "
            "(dist.destroy_process_group(group)) before compiling")
    grads = entry.grads
    return StepArtifact(
        logical=record_graph(runner.logical_gm),
        moves=[([n.name for n in m.nodes], m.target.name) for m in runner.graph.moves],
        expanded=record_graph(entry.graph),
        input_names=_input_names(runner.logical_gm),
        out_spec=pytree.treespec_dumps(entry.out_spec),
        grads={"inputs": grads.inputs, "outputs": grads.outputs, "kept": sorted(grads.kept),
               "specs": [_spec_record(s, state) for s in grads.specs]},
        dtensors={i: _spec_record(s, state) for i, s in entry.dtensors.items()},
        lowering=runner.lowering,
        live=dict(entry.live),
    )


def expected_input_names(state: StepState, n_inputs: int, grad_inputs: tuple) -> list[str]:
    """The names the step's graph inputs have for ``state``, ``n_inputs`` user tensors and the gradients
    taken (``GradPlan.inputs``), as ``spmd.trace.capture`` names them."""
    return (list(state.param_names) + list(state.buffer_names) + list(state.state_names)
            + [s.name for s in state.hyper_slots] + [f"input_{k}" for k in range(n_inputs)]
            + [f"{state.param_names[i]}.grad" for i in grad_inputs])


def _expanded(record: GraphRecord, parallel_mode: Any) -> fx.GraphModule:
    """The expanded graph ``record`` holds, marked with the live ``parallel_mode`` that expanded it."""
    expanded = load_graph(record)
    expanded.meta[PARALLEL_MODE] = parallel_mode
    return expanded


def step_from_artifact(artifact: StepArtifact, state: StepState, parallel_mode: Any,
                       n_inputs: int) -> Optional[CompiledStep]:
    """The ``CompiledStep`` ``artifact`` holds, for ``state`` and ``n_inputs`` user tensors, or None where
    the artifact does not fit them (another format, or graph inputs named otherwise)."""
    if artifact.format != FORMAT:
        return None
    if artifact.input_names != expected_input_names(state, n_inputs, tuple(artifact.grads["inputs"])):
        return None
    logical = load_graph(artifact.logical)
    if not roles_resolve(group_names_in(logical), _groups_of(state, parallel_mode)):
        return None  # a group role no group of this step plays here
    runner = IterGraphModule(logical)
    nodes = {n.name: n for n in runner.graph.nodes}
    for names, target in artifact.moves:
        runner.graph.move_to_next_iter_before([nodes[n] for n in names], nodes[target])
    runner.finalize_setup()
    runner.lowering = artifact.lowering
    grads = artifact.grads
    plan = GradPlan(tuple(grads["inputs"]), tuple(grads["outputs"]), [_spec(s, state) for s in grads["specs"]],
                    frozenset(grads["kept"]))
    return CompiledStep(runner, pytree.treespec_loads(artifact.out_spec),
                        functools.partial(_expanded, artifact.expanded, parallel_mode), grads=plan,
                        dtensors={i: _spec(s, state) for i, s in artifact.dtensors.items()}, live=dict(artifact.live))
