"""Inductor's compiled code for one of our graphs as data, so a restarted process runs it without Inductor.

What ``compile_fx_inner`` makes for a graph is a Python module (``CompiledFxGraph.source_code``) whose
``call(args)`` runs the graph: its kernels are written into it as source and compiled when it is loaded,
through Triton's cache on a GPU and Inductor's C++ cache on the CPU, so a machine whose caches are warm
loads them in a moment and one whose caches are cold compiles them again, correctly. Keeping that module
beside the step's artifact spares a restart everything before it: preparing the graph for Inductor,
propagating fake values, the joint-graph passes and Inductor's own cache lookup, which hashes the graph.

A graph whose compiled form needs more than its module (constants held on the side, script objects) is
not kept: ``code_of`` returns None and the graph is compiled on each restart, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

@dataclass(frozen=True)
class InductorCode:
    """What runs one compiled graph: Inductor's module source and how its inputs must be aligned."""

    source: str
    linemap: tuple
    inputs_to_check: tuple  # inputs the kernels assume aligned: a misaligned one is copied first
    mutated_inputs: tuple  # inputs the graph writes: a copied one is written back
    wrapped_ops: tuple = ()  # names of the ops the code calls as ``spmd_lowering`` ops (defined before loading)


def _empty(value: Any) -> bool:
    return value is None or len(value) == 0


def code_of(compiled: Any, wrapped_ops: tuple = ()) -> Optional[InductorCode]:
    """``compiled`` (what ``compile_fx_inner`` returned; ``wrapped_ops``: the names of the ops its graph called
    through ``spmd.lower.inductor.opaque_inplace_op``) as an ``InductorCode``, or None where its module
    alone does not run it (it holds constants or script objects on the side, or this torch names its
    parts otherwise)."""
    needed = ("source_code", "inputs_to_check", "mutated_input_idxs")
    if not all(hasattr(compiled, name) for name in needed) or not isinstance(compiled.source_code, str):
        return None
    if not all(_empty(getattr(compiled, name, None))
               for name in ("constants", "torchbind_constants", "opaque_value_type_classes", "frozen_param_names")):
        return None
    return InductorCode(compiled.source_code, tuple(getattr(compiled, "cache_linemap", None) or ()),
                        tuple(compiled.inputs_to_check), tuple(sorted(compiled.mutated_input_idxs)), tuple(wrapped_ops))


def load_code(code: InductorCode) -> Callable[[list], Any]:
    """A callable running ``code`` on a list of the graph's inputs (Inductor's boxed convention: it may
    clear the list), compiling its kernels now where the kernel caches do not hold them."""
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.utils import align_inputs_from_check_idxs
    from torch.utils._ordered_set import OrderedSet

    key, path = PyCodeCache.write(code.source)
    module = PyCodeCache.load_by_key_path(key, path, list(code.linemap))
    return align_inputs_from_check_idxs(module.call, list(code.inputs_to_check), OrderedSet(code.mutated_inputs))
