"""Inductor's decompositions applied node by node, so Inductor can take our graph without re-tracing it.

``torch._inductor.compile_fx.compile_fx`` runs AOT autograd over its input: a second
``make_fx`` trace of the whole step under functionalization, whose only effect on a
graph that is already functional (ours) is to apply Inductor's decomposition table, a large
part of a first call (BENCHMARKS.md, "First call: Inductor without AOT autograd's re-trace").
``decompose_for_inductor`` applies
the same table locally: each node whose op the table decomposes is replaced by a trace
of its decomposition on the node's fake values. The twelve blocks of a GPT repeat the
same few (op, shapes) pairs, so each distinct pair is traced once and copied.

What comes out is what AOT's re-trace would have produced, op for op: the same
decompositions, applied recursively by ``make_fx``, with every other node untouched
(``tests/test_inductor_lowering.py`` compares the two). One exception: a decomposition that lays
its result out otherwise than the op is followed by a copy into the op's layout, since the
untouched users were traced for it (``graph_utils.decompose_node.trace_decomposition``).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from ..errors import SpmdCompileError
from ..graph_utils.decompose_node import decomposition_key, splice, tensor_args, trace_decomposition

log = logging.getLogger(__name__)


def decompose_for_inductor(graph: fx.Graph, table: Optional[dict] = None) -> None:
    """Decompose, in place, every node of ``graph`` whose op is in ``table`` (default: Inductor's
    ``select_decomp_table()``).

    Before: a functional aten graph with ``meta["val"]`` on every node (our traced step).
    After: the same computation, each decomposable node replaced by its decomposition,
    which is what AOT autograd's re-trace would have handed ``compile_fx_inner``. A node
    whose decomposition is not a pure function of its arguments is left as it is. The new
    nodes' ``meta["val"]`` come from a fake mode of their own: propagate again before
    reading values across the graph.
    """
    import torch._inductor.lowering  # noqa: F401 - decompositions consult it (max pooling's, whether it falls back)

    if table is None:
        from torch._inductor.decomposition import select_decomp_table

        table = select_decomp_table()
    traced: dict[tuple, Optional[fx.GraphModule]] = {}
    mode = FakeTensorMode()
    counts = {"decomposed": 0, "kept": 0}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in table:
            continue
        args = tensor_args(node)
        if args is None:
            counts["kept"] += 1
            continue
        key = decomposition_key(node)
        if key not in traced:
            try:
                traced[key] = trace_decomposition(node, table, mode)
            except Exception as err:
                raise SpmdCompileError(
                    f"spmd: Inductor's decomposition of {node.target} failed on node {node.name} "
                    f"({type(err).__name__}: {err}). Run this step without Inductor "
                    "(GraphModuleTransformation(enable_graph_optimization=True)) and report the op."
                ) from err
        sub = traced[key]
        done = sub is not None and splice(graph, node, sub, args) is not None
        counts["decomposed" if done else "kept"] += 1
    graph.lint()
    log.debug("spmd: decomposed %d nodes for Inductor (%d distinct traces), kept %d",
              counts["decomposed"], len(traced), counts["kept"])
