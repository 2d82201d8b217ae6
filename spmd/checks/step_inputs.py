"""Refuse, before a step is traced or cached, what its inputs or its transformation get wrong: parameters left
on the meta device or on another device than their mesh, an optimizer built before ``spmd.shard``, a
transformation whose runner cannot take the step's graph inputs, ``spmd.compile``'s own arguments.
Each check raises ``SpmdCompileError`` or ``SpmdConfigError`` naming the cause and the fix.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any, Callable, Optional

import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from ..compile_options import CompileOptions
from ..errors import SpmdCompileError, SpmdConfigError
from ..step.compiled_step import CompiledStep
from ..step.iter_graph_module import IterGraphModule


def check_materialized(modules: list[nn.Module]) -> None:
    """Refuse parameters or buffers left on the meta device: a step cannot compute with them."""
    on_meta = [f"{name} ({'parameter' if kind else 'buffer'})" for mod in modules
               for kind, named in ((True, mod.named_parameters()), (False, mod.named_buffers())) for name, t in named
               if t.is_meta]
    if on_meta:
        others = sorted({t.device.type for mod in modules for t in (*mod.parameters(), *mod.buffers()) if not t.is_meta})
        also = f" (the rest of the model is on {', '.join(others)})" if others else ""
        raise SpmdCompileError(
            f"spmd.compile: {on_meta[:3]}{'...' if len(on_meta) > 3 else ''} are on the meta device{also}: they have "
            "no values to train. Materialize the model before calling the compiled step: model.to_empty(device=...) "
            "and initialize it (e.g. model.reset_parameters() per module), or load a state dict with assign=True."
        )


def check_dense_gradients(modules: list[nn.Module]) -> None:
    """Refuse embeddings that make sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag``'s too):
    a step graph holds dense tensors, and its gradient collectives and fused optimizers take dense ones."""
    sparse = [name for mod in modules for name, m in mod.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]
    if sparse:
        raise SpmdCompileError(
            f"spmd.compile: the embeddings {sparse[:3]}{'...' if len(sparse) > 3 else ''} make sparse gradients "
            "(sparse=True), which a compiled step, whose gradients, collectives and optimizer updates are dense "
            "tensors, cannot hold. Build them with sparse=False (the default).")


def mesh_device_mismatches(modules: list[nn.Module]) -> list[str]:
    """The sharded parameters whose data is on another device type than their DeviceMesh (``name (data on
    cuda, mesh on cpu)``): their collectives would run over the mesh's backend on the wrong device."""
    return [f"{name} (data on {p._local_tensor.device.type}, mesh on {p.device_mesh.device_type})"
            for mod in modules for name, p in mod.named_parameters()
            if isinstance(p, DTensor) and p._local_tensor.device.type != p.device_mesh.device_type]


def check_mesh_devices(modules: list[nn.Module]) -> None:
    """Refuse, naming the fix, sharded parameters whose data and DeviceMesh are on different device types."""
    wrong = mesh_device_mismatches(modules)
    if wrong:
        raise SpmdCompileError(
            f"spmd.compile: sharded parameters {wrong[:3]}{'...' if len(wrong) > 3 else ''} are not on their "
            "DeviceMesh's device type, so their collectives would run on the wrong device. Move the model to its "
            "device before spmd.shard(model, mode) (not after), or build the mesh on the data's device "
            "(init_device_mesh('cuda', ...) with an NCCL process group)."
        )


def check_optimizers_follow_modules(modules: list[nn.Module], optimizers: list) -> None:
    """Refuse, naming the fix, an optimizer that holds a sharded model's parameters as they were before
    ``spmd.shard`` replaced them."""
    params = {id(p) for mod in modules for p in mod.parameters()}
    sharded = any(isinstance(p, DTensor) for mod in modules for p in mod.parameters())
    for optim in optimizers:
        stray = [p for g in optim.param_groups for p in g["params"] if id(p) not in params]
        if sharded and stray and not any(isinstance(p, DTensor) for p in stray):
            raise SpmdCompileError(
                f"spmd.compile: the {type(optim).__name__} was built before spmd.shard replaced the model's "
                "parameters with sharded ones, so it holds the old, unsharded parameters. Build the optimizer after "
                "spmd.shard(model, mode), as with FSDP2's fully_shard: spmd.shard(model, mode); "
                "optim = torch.optim.AdamW(model.parameters(), ...)."
            )


def runner_for(transformation: Callable, runner: Any, n_inputs: int) -> Callable:
    """What runs the step, called with its ``n_inputs`` graph inputs positionally, from what ``transformation``
    returned: ``runner`` itself, or for an ``fx.GraphModule`` that takes them in another structure (one made
    by ``make_fx(lambda inputs: gm(*inputs))`` takes one list) a call that builds that structure. Anything else
    that cannot take them is refused (``SpmdConfigError``) before the step is cached or runs."""
    name = getattr(transformation, "__name__", type(transformation).__name__)
    must = ("It must return what runs the step on the graph's inputs, passed positionally as the GraphModule it was "
            "given takes them: that GraphModule (edited or not), an IterGraphModule, another fx.GraphModule with "
            "the same placeholders, or a compiled callable taking the same inputs.")
    if not callable(runner):
        raise SpmdConfigError(
            f"spmd.compile: gm_transformation {name} returned {type(runner).__name__} {runner!r}, not a callable. "
            + must)
    if isinstance(runner, IterGraphModule):
        return runner
    if isinstance(runner, fx.GraphModule):
        taken = sum(1 for _ in runner.graph.find_nodes(op="placeholder"))
        in_spec = getattr(getattr(runner.graph._codegen, "pytree_info", None), "in_spec", None)
        if in_spec is not None and in_spec.num_leaves == n_inputs and not _takes_positionally(runner, n_inputs):
            return functools.partial(_call_structured, runner, in_spec)
        if taken != n_inputs:
            raise SpmdConfigError(
                f"spmd.compile: gm_transformation {name} returned an fx.GraphModule with {taken} inputs "
                f"(placeholders), where the step has {n_inputs}. " + must)
    if not _takes_positionally(runner, n_inputs):
        raise SpmdConfigError(
            f"spmd.compile: gm_transformation {name} returned {type(runner).__name__} {runner!r}, which cannot be "
            f"called with the step's {n_inputs} graph inputs. " + must)
    return runner


def check_outputs(transformation: Optional[Callable], entry: CompiledStep, returned: int) -> None:
    """Refuse, on the first run, a runner that returned another number of values than the step's graph."""
    expected = entry.out_spec.num_leaves + len(entry.grads.outputs if entry.grads else ())
    if returned != expected:
        name = getattr(transformation, "__name__", type(transformation).__name__)
        raise SpmdConfigError(
            f"spmd.compile: what gm_transformation {name} returned gave {returned} values where the step's graph "
            f"returns {expected}. It must return what runs the step and returns the graph's outputs, flat, in order "
            "(as the fx.GraphModule it was given does).")


def _takes_positionally(runner: Callable, n: int) -> bool:
    """Whether ``runner``'s signature accepts ``n`` positional arguments (True where it has none to read)."""
    try:
        signature = inspect.signature(runner.forward if isinstance(runner, nn.Module) else runner)
    except (TypeError, ValueError):  # a builtin or extension callable: its call will tell
        return True
    try:
        signature.bind(*range(n))
    except TypeError:
        return False
    return True


def _call_structured(runner: fx.GraphModule, in_spec: pytree.TreeSpec, *flat: Any) -> Any:
    """``runner`` called with ``flat``, the graph's inputs, arranged as its ``in_spec`` says: its positional
    arguments, or ``(args, kwargs)``."""
    structured = pytree.tree_unflatten(list(flat), in_spec)
    if (in_spec.type is tuple and in_spec.num_children == 2 and in_spec.child(0).type is tuple
            and in_spec.child(1).type is dict):
        return runner(*structured[0], **structured[1])
    return runner(*structured)


def check_compile_arguments(module_override: Any, gm_transformation: Any, cache_dir: Any = None,
                            options: Any = None) -> None:
    """Refuse, where ``spmd.compile(...)`` is written, arguments it cannot use (``SpmdConfigError``)."""
    if module_override is not None and not isinstance(module_override, (list, tuple)):
        raise SpmdConfigError(f"spmd.compile: module_override must be a list of overrides, got "
                              f"{type(module_override).__name__} {module_override!r}.")
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike, bool)):
        raise SpmdConfigError(f"spmd.compile: cache_dir must be a directory (str or path), or False to turn the "
                              f"compile cache off, got {type(cache_dir).__name__} {cache_dir!r}.")
    if gm_transformation is not None and not callable(gm_transformation):
        raise SpmdConfigError(
            f"spmd.compile: gm_transformation must be a callable taking the expanded fx.GraphModule and returning "
            f"a callable (e.g. spmd.GraphModuleTransformation(...)), got {type(gm_transformation).__name__} "
            f"{gm_transformation!r}.")
    if options is not None and not isinstance(options, CompileOptions):
        raise SpmdConfigError(f"spmd.compile: options must be an spmd.CompileOptions, got {type(options).__name__} "
                              f"{options!r}; e.g. spmd.compile(options=spmd.CompileOptions(cache_size=4)).")
