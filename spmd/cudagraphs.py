"""Replay a compiled step (or setup/main/cleanup part) as one CUDA graph.

A training step launches hundreds of kernels; at small batch sizes the CPU cannot
launch them as fast as the GPU runs them. A CUDA graph launches them all at once.

The step graph makes this safe: parameters, buffers and optimizer state are graph
inputs updated in place, so they are the graph's static inputs as they are (their
storage must stay put; a moved one is detected and the graph is captured again).
The batch, and values carried between iterations, are copied into static buffers
before each replay. The hyperparameter tensors (lr, betas, ...) are persistent too:
``spmd.compile`` fills them in place when a value changes. NCCL collectives are captured with the rest (the process
group's communicator exists by then: the first call runs uncaptured, as warm-up).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

from .compile_times import phase
from .errors import SpmdCompileError

log = logging.getLogger(__name__)


class CudaGraphRunner:
    """Runs ``fn`` uncaptured on its first call, captures it on the second, then replays.

    ``persistent[i]``: input ``i`` is updated in place or read in place (parameters,
    state, hyperparameters) and is used by the graph directly; other inputs are copied into static
    buffers. The first ``num_user_outputs`` outputs are cloned for the caller (the
    next replay overwrites the static ones); the rest are values carried to the next
    iteration and are handed back as they are, to be copied in again.
    """

    def __init__(self, fn: Callable, persistent: Sequence[bool], num_user_outputs: int, label: str = "step"):
        self.fn = fn
        self.persistent = list(persistent)
        self.num_user_outputs = num_user_outputs
        self.label = label
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.static_inputs: list = []
        self.static_outputs: tuple = ()
        self.pointers: list[int] = []
        self.warmed_up = False
        self.captures = 0

    def _check_inputs(self, args: tuple) -> None:
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.device.type != "cuda":
                raise SpmdCompileError(
                    f"spmd: enable_cudagraphs=True, but input {i} of the {self.label} graph (shape "
                    f"{tuple(a.shape)}) is on {a.device}; a CUDA graph replays only GPU work. Keep the "
                    "model, the batch and the optimizer state on the GPU (optimizers need capturable=True "
                    "so their step counters live there), or turn enable_cudagraphs off."
                )

    def _persistent_moved(self, args: tuple) -> bool:
        return [a.data_ptr() for a, p in zip(args, self.persistent) if p] != self.pointers

    def _outputs(self) -> tuple:
        return tuple(o.clone() if i < self.num_user_outputs and isinstance(o, torch.Tensor) else o
                     for i, o in enumerate(self.static_outputs))

    def _capture(self, args: tuple) -> None:
        self.static_inputs = [a if p else a.clone() for a, p in zip(args, self.persistent)]
        self.pointers = [a.data_ptr() for a, p in zip(args, self.persistent) if p]
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        try:
            # thread_local: the NCCL watchdog thread keeps querying events during capture
            with phase(f"cudagraph/{self.label}/capture"), torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.static_outputs = tuple(self.fn(*self.static_inputs))
        except Exception as e:  # capture records work and runs none: nothing of the user's changed
            self.static_inputs, self.static_outputs = [], ()
            raise SpmdCompileError(
                f"spmd: capturing the {self.label} graph as a CUDA graph failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}). Parameters and optimizer state are unchanged; "
                "run with enable_cudagraphs=False."
            ) from e
        self.graph = graph
        self.captures += 1
        log.info("spmd: captured the %s graph as a CUDA graph (capture #%d)", self.label, self.captures)

    def __call__(self, *args):
        if not self.warmed_up:
            self._check_inputs(args)
            self.warmed_up = True
            return tuple(self.fn(*args))
        if self.graph is not None and self._persistent_moved(args):
            log.warning("spmd: a parameter or optimizer state tensor of the %s graph moved to new storage; "
                        "capturing the CUDA graph again", self.label)
            self.graph = None
        if self.graph is None:
            self._capture(args)  # this call's inputs are the static ones: no copies needed
        else:
            for static, a, p in zip(self.static_inputs, args, self.persistent):
                if not p and static.data_ptr() != a.data_ptr():
                    static.copy_(a)
        self.graph.replay()
        return self._outputs()
