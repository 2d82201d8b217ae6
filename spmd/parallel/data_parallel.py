"""``DataParallel``: the user's choice of parallel mode and its settings.

Each mode is one module of this package with the same two functions, in the way
torchtitan keeps ``apply_ddp`` and ``apply_fsdp`` side by side:

* ``prepare(dp, state, modules)``: runs before the first run of a compiled step on
  ``modules`` (those of ``state`` it has not run on before), after its graph was traced
  and checked on every rank (e.g. make replicas equal);
* ``expand(dp, gm, grad_order=None)``: turns the traced single-rank graph into the
  distributed one (e.g. an all_reduce per gradient); ``grad_order`` is the order every
  rank reduces gradients in when some rank computes no gradient for a parameter
  (``spmd.rank_check``).

``DataParallel`` holds the settings and hands itself to the chosen mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch.distributed as dist
import torch.fx as fx

from . import replicate

STYLES = {"replicate": replicate}


@dataclass
class DataParallel:
    """How a train step is spread over ranks.

    ``DataParallel("replicate", grad_reduce="sum" | "avg", group=None)``: each rank
    passes its own local batch (as with DDP); gradients are summed (or averaged) over
    ``group`` (default: the default process group). ``"avg"`` divides each gradient by
    the world size before the sum, exactly as DDP does, on every backend.

    Settings of the replicate style, named and defaulted as in DDP/FSDP:

    * ``sync_module_states=True``: before a step first runs on a module, its parameters
      (and buffers, with ``broadcast_buffers``) are overwritten with rank 0's, as DDP does
      when it is built. ``False``: the ranks must build equal modules themselves.
    * ``broadcast_buffers=True``: every forward of a module passed to the step starts from
      rank 0's buffers (one broadcast per dtype inside the graph), as DDP's default does;
      buffers updated in the forward (BatchNorm statistics) then differ per rank until the
      next forward. ``False``: each rank keeps its own buffers.
    """

    parallel_style: str = "replicate"
    grad_reduce: str = "sum"
    group: Optional[dist.ProcessGroup] = None
    sync_module_states: bool = True
    broadcast_buffers: bool = True

    def __post_init__(self):
        if self.parallel_style not in STYLES:
            raise NotImplementedError(
                f"spmd.DataParallel: parallel_style={self.parallel_style!r} is not implemented; "
                f"choose one of {sorted(STYLES)}."
            )
        if self.grad_reduce not in ("sum", "avg"):
            raise ValueError(f"spmd.DataParallel: grad_reduce must be 'sum' or 'avg', got {self.grad_reduce!r}")
        for name in ("sync_module_states", "broadcast_buffers"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"spmd.DataParallel: {name} must be True or False, got {getattr(self, name)!r}")

    @property
    def mode(self):
        """The module that implements ``parallel_style`` (``prepare`` and ``expand``)."""
        return STYLES[self.parallel_style]

    def process_group(self) -> Optional[dist.ProcessGroup]:
        """The group gradients are reduced over, or None when no process group is initialized."""
        if not dist.is_available() or not dist.is_initialized():
            return None
        return self.group or dist.distributed_c10d._get_default_group()

    def broadcasts_buffers(self) -> bool:
        """True when each forward of the step's modules must start from rank 0's buffers
        (``broadcast_buffers`` over more than one rank): tracing then marks every forward."""
        group = self.process_group()
        return self.broadcast_buffers and group is not None and dist.get_world_size(group) > 1

    def prepare(self, state, modules: Sequence) -> None:
        """Mode-specific work on ``modules`` (of ``state``) before a step first runs on them."""
        self.mode.prepare(self, state, modules)

    def expand(self, gm: fx.GraphModule, grad_order: Optional[Sequence[tuple[int, int]]] = None) -> fx.GraphModule:
        """The traced single-rank graph, expanded for this mode (edited in place)."""
        return self.mode.expand(self, gm, grad_order)
