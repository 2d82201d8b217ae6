"""Replicated data parallel: every rank holds all parameters and all-reduces gradients.

The expansion replaces each ``spmd::tag_grad`` marker left by tracing with a functional
all_reduce and its ``wait_tensor``, right where the gradient is produced in the backward.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.fx as fx

from ..graph_utils import set_fake_val
from ..graph_utils.meta import GRAD_OF
from ..tracing import TAG_GRAD, tag_gradients

log = logging.getLogger(__name__)
c10d = torch.ops._c10d_functional


def prepare(dp, state) -> None:
    """Nothing to do before tracing (yet)."""


def trace_context(dp, state, params):
    """While tracing: tag each trained parameter's gradient, for ``expand``."""
    return tag_gradients(state, params)


def expand(dp, gm: fx.GraphModule) -> fx.GraphModule:
    """Insert one all_reduce + wait per gradient; return the same module, edited."""
    tags = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is TAG_GRAD]
    group = dp.process_group()
    if group is None:
        log.info("spmd: no process group initialized; running as a single process (no gradient all_reduce)")
    world_size = dist.get_world_size(group) if group is not None else 1
    graph = gm.graph
    for tag in tags:
        grad = tag.args[0]
        if group is None:
            tag.replace_all_uses_with(grad)
            graph.erase_node(tag)
            continue
        # issue the collective as soon as the gradient exists
        with graph.inserting_after(grad):
            if dp.grad_reduce == "avg" and world_size > 1:
                grad = graph.call_function(torch.ops.aten.div.Scalar, (grad, world_size))
                set_fake_val(grad)
        with graph.inserting_after(grad):
            reduced = graph.call_function(c10d.all_reduce.default, (grad, "sum", group.group_name))
            set_fake_val(reduced)
        with graph.inserting_after(reduced):
            waited = graph.call_function(c10d.wait_tensor.default, (reduced,))
            set_fake_val(waited)
        for n in (reduced, waited):
            n.meta[GRAD_OF] = tag.args[1]
        tag.replace_all_uses_with(waited)
        graph.erase_node(tag)
    graph.lint()
    gm.recompile()
    return gm
