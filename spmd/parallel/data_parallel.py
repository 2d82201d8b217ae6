"""``DataParallel``: the user's choice of parallel mode and its settings.

Each mode is one module of this package with the same two functions, in the way
torchtitan keeps ``apply_ddp`` and ``apply_fsdp`` side by side:

* ``prepare(dp, state)``: runs on the first call of a compiled step for its modules
  and optimizers, before tracing (e.g. make replicas equal);
* ``expand(dp, gm)``: turns the traced single-rank graph into the distributed one
  (e.g. an all_reduce per gradient).

``DataParallel`` holds the settings and hands itself to the chosen mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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
    """

    parallel_style: str = "replicate"
    grad_reduce: str = "sum"
    group: Optional[dist.ProcessGroup] = None

    def __post_init__(self):
        if self.parallel_style not in STYLES:
            raise NotImplementedError(
                f"spmd.DataParallel: parallel_style={self.parallel_style!r} is not implemented; "
                f"choose one of {sorted(STYLES)}."
            )
        if self.grad_reduce not in ("sum", "avg"):
            raise ValueError(f"spmd.DataParallel: grad_reduce must be 'sum' or 'avg', got {self.grad_reduce!r}")

    @property
    def mode(self):
        """The module that implements ``parallel_style`` (``prepare`` and ``expand``)."""
        return STYLES[self.parallel_style]

    def process_group(self) -> Optional[dist.ProcessGroup]:
        """The group gradients are reduced over, or None when no process group is initialized."""
        if not dist.is_available() or not dist.is_initialized():
            return None
        return self.group or dist.distributed_c10d._get_default_group()

    def prepare(self, state) -> None:
        """Mode-specific work on the step's modules and optimizers before their first trace."""
        self.mode.prepare(self, state)

    def expand(self, gm: fx.GraphModule) -> fx.GraphModule:
        """The traced single-rank graph, expanded for this mode (edited in place)."""
        return self.mode.expand(self, gm)
