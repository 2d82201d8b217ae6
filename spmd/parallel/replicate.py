"""Replicated data parallel: every rank holds all parameters and all-reduces gradients.

The expansion replaces each ``spmd::tag_grad`` marker left by tracing with a functional
all_reduce and its ``wait_tensor``, right where the gradient is produced in the backward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.fx as fx

from graph_utils import set_fake_val

from ..tracing import TAG_GRAD

log = logging.getLogger(__name__)
c10d = torch.ops._c10d_functional


@dataclass
class DataParallel:
    """How a train step is spread over ranks.

    ``DataParallel("replicate", grad_reduce="sum" | "avg", group=None)``: each rank
    passes its own local batch (as with DDP); gradients are summed (or averaged) over
    ``group`` (default: the default process group). ``"avg"`` divides each gradient by
    the world size before the sum, exactly as DDP does, on every backend.
    """

    parallel_style: str = "replicate"
    grad_reduce: str = "sum"
    group: Optional[dist.ProcessGroup] = None

    def __post_init__(self):
        if self.parallel_style != "replicate":
            raise NotImplementedError(
                f"spmd.DataParallel: parallel_style={self.parallel_style!r} is not implemented yet; "
                "only 'replicate' is available."
            )
        if self.grad_reduce not in ("sum", "avg"):
            raise ValueError(f"spmd.DataParallel: grad_reduce must be 'sum' or 'avg', got {self.grad_reduce!r}")

    def expand(self, gm: fx.GraphModule) -> fx.GraphModule:
        """Insert one all_reduce + wait per gradient; return the same module, edited."""
        tags = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is TAG_GRAD]
        if not dist.is_available() or not dist.is_initialized():
            log.info("spmd: no process group initialized; running as a single process (no gradient all_reduce)")
            world_size, group_name = 1, None
        else:
            group = self.group or dist.distributed_c10d._get_default_group()
            world_size, group_name = dist.get_world_size(group), group.group_name
        for tag in tags:
            grad = tag.args[0]
            graph = gm.graph
            if group_name is None:
                tag.replace_all_uses_with(grad)
                graph.erase_node(tag)
                continue
            # issue the collective as soon as the gradient exists
            with graph.inserting_after(grad):
                if self.grad_reduce == "avg" and world_size > 1:
                    grad = graph.call_function(torch.ops.aten.div.Scalar, (grad, world_size))
                    set_fake_val(grad)
            with graph.inserting_after(grad):
                reduced = graph.call_function(c10d.all_reduce.default, (grad, "sum", group_name))
                set_fake_val(reduced)
            with graph.inserting_after(reduced):
                waited = graph.call_function(c10d.wait_tensor.default, (reduced,))
                set_fake_val(waited)
            for n in (reduced, waited):
                n.meta["spmd_grad_of"] = tag.args[1]
            tag.replace_all_uses_with(waited)
            graph.erase_node(tag)
        gm.graph.lint()
        gm.recompile()
        return gm
