"""Replay a compiled step (or setup/main/cleanup part) as a CUDA graph.

A training step launches hundreds of kernels; at small batch sizes the CPU cannot
launch them as fast as the GPU runs them. A CUDA graph launches them all at once.

The step graph makes this safe: parameters, buffers and optimizer state are graph
inputs updated in place, so they are the graph's static inputs as they are (their
storage must stay put; a moved one is detected and the graph is captured again).
The hyperparameter tensors (lr, betas, ...) are persistent too: ``spmd.compile`` fills them in place when a
value changes. The batch, and values carried between iterations, are copied into static buffers before each
replay. Those buffers live in the graph's memory pool and nothing but the captured code holds them, so the
memory of one the step last reads early (a float32 batch cast to bfloat16 by the first op) goes to what the
graph allocates after that read, as the recording inputs of torch.compile's CUDA graph trees do; a carried
output that lands on such a buffer is copied aside before the next call's inputs are copied in.

NCCL collectives are captured with the rest (the process group's communicator exists by then: the first call
runs uncaptured, as warm-up). An op sized on the host (a mixture-of-experts loop over each expert's row count)
runs eagerly between graphs captured before and after it (``spmd.lower.cudagraph_segments``); a step without
one is one graph.

cuBLAS keeps a scratch workspace per stream and a captured matmul keeps using the one it was captured
with. A workspace made outside this graph's memory pool (by an earlier capture on the same stream, whose
pool it lives in) can be freed under the graph: ``torch.compile(mode="reduce-overhead")`` releases every
cuBLAS workspace whenever it records, and the graph's replays would then write into memory that is
another tensor's or unmapped. So the workspaces are released before the capture, which makes its own in
this graph's pool, and again after it, so that no later work uses the one this graph keeps. They are also
released before the uncaptured warm-up (as the CUDA graph trees do before theirs): a workspace left idle on
another stream (an earlier capture's, or the user's side stream's) is then not held through the first
step's peak; the warm-up's own matmuls make the one they use.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

import torch.fx as fx

from ..compile_times import phase
from ..errors import SpmdCompileError
from ..graph_utils.meta import NAME, ROLE, Role
from .cudagraph_segments import CudaGraphSegments, storage_span, unowned_view

log = logging.getLogger(__name__)


def cudagraph_obstacle(gm: fx.GraphModule, args: tuple) -> Optional[str]:
    """Why ``gm`` cannot run as a CUDA graph with inputs ``args`` (the first input it reads not on the
    GPU), or None. An input the graph never reads does not count (e.g. a module's tensor attribute
    that ``model.to("cuda")`` left on the CPU, read like a buffer but unused)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = [(n.meta.get(NAME), n.meta.get(ROLE)) for n in placeholders]
    for i, a in enumerate(args):
        if i < len(placeholders) and not placeholders[i].users:
            continue
        if isinstance(a, torch.Tensor) and a.device.type != "cuda":
            name, role = names[i] if i < len(names) else (None, None)
            what = f"input {name or i} (shape {tuple(a.shape)}) is on {a.device}"
            if role == Role.STATE:
                return f"{what}; build the optimizer with capturable=True so its state stays on the GPU"
            return f"{what}; keep the model, its buffers and the batch on the GPU"
    return None


def release_matmul_workspaces() -> None:
    """Drop cuBLAS's per-stream workspaces (the next matmul on a stream makes a new one); what a CUDA
    graph captured with one keeps using stays in that graph's pool (see the module docstring). Nothing to do
    without CUDA."""
    if torch.cuda.is_available():
        torch._C._cuda_clearCublasWorkspaces()


class CudaGraphRunner:
    """Runs ``fn`` uncaptured on its first call, captures it on the second, then replays.

    ``persistent[i]``: input ``i`` is updated in place or read in place (parameters,
    state, hyperparameters) and is used by the graph directly; other inputs are copied into static
    buffers. The first ``num_user_outputs`` outputs are cloned for the caller (the
    next replay overwrites the static ones); the rest are values carried to the next
    iteration and are handed back as they are, to be copied in again. ``fall_back``: when the
    capture fails, warn and run ``fn`` uncaptured from then on instead of raising. ``unread[i]``:
    the graph never reads input ``i`` (see ``cudagraph_obstacle``): it may live anywhere and is
    never copied. ``names[i]``: input ``i`` in the user's terms (``meta[NAME]``: a parameter, buffer or
    optimizer state name), for the message when a persistent input moved. ``captures``: how many times
    the graph was captured.
    """

    def __init__(self, fn: Callable, persistent: Sequence[bool], num_user_outputs: int, label: str = "step",
                 fall_back: bool = False, unread: Sequence[bool] = (), names: Sequence[Optional[str]] = ()):
        self.fn = fn
        self.names = [n or f"input {i}" for i, n in enumerate(list(names) + [None] * (len(persistent) - len(names)))]
        self.warned_moved = False  # the first recapture is a warning, later ones are logged at INFO
        self.unread = list(unread) + [False] * (len(persistent) - len(unread))
        self.persistent = [p or u for p, u in zip(persistent, self.unread)]
        self.num_user_outputs = num_user_outputs
        self.label = label
        self.graph: Optional[CudaGraphSegments] = None
        self.static_inputs: list = []  # persistent inputs as they are; the others as views owning no memory
        self.static_outputs: tuple = ()
        self.pointers: list[int] = []
        self.carried_over_inputs: frozenset[int] = frozenset()  # storages of carried outputs on static buffers
        self.warmed_up = False
        self.captures = 0
        self.fall_back = fall_back
        self.uncaptured = False  # a capture failed and fall_back is on: fn runs as it is

    def _check_inputs(self, args: tuple) -> None:
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.device.type != "cuda" and not self.unread[i]:
                raise SpmdCompileError(
                    f"spmd: enable_cudagraphs=True, but input {i} of the {self.label} graph (shape "
                    f"{tuple(a.shape)}) is on {a.device}; a CUDA graph replays only GPU work. Keep the "
                    "model, the batch and the optimizer state on the GPU (optimizers need capturable=True "
                    "so their step counters live there), or turn enable_cudagraphs off."
                )

    def _persistent_moved(self, args: tuple) -> bool:
        return [a.data_ptr() for a, p in zip(args, self.persistent) if p] != self.pointers

    def _moved_inputs(self, args: tuple) -> str:
        """Which persistent inputs moved since the capture, by name, and how (for the recapture message)."""
        moved = []
        for name, a, static, p in zip(self.names, args, self.static_inputs, self.persistent):
            if p and a.data_ptr() != static.data_ptr():
                moved.append(f"{name} (another tensor now holds its place: the module, optimizer or scaler was given "
                             "a new tensor, e.g. by rebinding it, load_state_dict(assign=True) or .to())"
                             if a is not static else f"{name} (the same tensor, its storage replaced, e.g. by set_())")
        return "; ".join(moved[:3]) + (f"; and {len(moved) - 3} more" if len(moved) > 3 else "")

    def _outputs(self) -> tuple:
        return tuple(o.clone() if i < self.num_user_outputs and isinstance(o, torch.Tensor) else o
                     for i, o in enumerate(self.static_outputs))

    def _capture(self, args: tuple) -> None:
        """Capture ``fn`` on this call's inputs, the persistent ones as they are and copies of the others in the
        graph's pool (the static buffers, held here only as views that own no memory); the capture runs the step
        once (``CudaGraphSegments``), so this call's outputs are the static outputs as they are now."""
        graph = CudaGraphSegments()
        copies = iter(graph.copies_in_pool([a for a, p in zip(args, self.persistent) if not p]))
        inputs = [a if p else next(copies) for a, p in zip(args, self.persistent)]
        del copies
        self.static_inputs = [a if p else unowned_view(a) for a, p in zip(inputs, self.persistent)]
        self.pointers = [a.data_ptr() for a, p in zip(args, self.persistent) if p]
        torch.cuda.synchronize()
        release_matmul_workspaces()  # the capture's cuBLAS workspace is then made in the graph's own pool
        try:
            # thread_local: the NCCL watchdog thread keeps querying events during capture
            with phase(f"cudagraph/{self.label}/capture"):
                boxed = getattr(self.fn, "boxed", None)
                self.static_outputs = (graph.capture(boxed, inputs, boxed=True) if boxed is not None
                                       else graph.capture(self.fn, inputs))
            self.carried_over_inputs = self._carried_over_inputs()
        except Exception as e:  # capture records work and runs none of the user's state writes: nothing changed
            self.static_inputs, self.static_outputs = [], ()
            if self.fall_back:
                log.warning("spmd: the %s graph runs without CUDA graphs: its capture failed (%s: %s)", self.label,
                            type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                self.uncaptured = True
                return
            raise SpmdCompileError(
                f"spmd: capturing the {self.label} graph as a CUDA graph failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}). Parameters and optimizer state are unchanged; "
                "run with enable_cudagraphs=False."
            ) from e
        finally:
            release_matmul_workspaces()  # the graph keeps its workspace; later matmuls make their own
        self.graph = graph
        self.captures += 1
        log.info("spmd: captured the %s graph as %d CUDA graph(s) (capture #%d)", self.label, len(graph.graphs),
                 self.captures)

    def _carried_over_inputs(self) -> frozenset[int]:
        """The storages of the carried outputs (handed back to be copied in again) that overlap a static buffer:
        the graph wrote them after the buffer's last read, and the next call's copies into the buffers would
        overwrite them before they are read."""
        buffers = [storage_span(s) for s, p in zip(self.static_inputs, self.persistent) if not p]

        def on_a_buffer(t: torch.Tensor) -> bool:
            start, end = storage_span(t)
            return any(start < b_end and b_start < end for b_start, b_end in buffers)

        carried = [o for o in self.static_outputs[self.num_user_outputs:] if isinstance(o, torch.Tensor)]
        return frozenset(storage_span(o)[0] for o in carried if on_a_buffer(o))

    def _copy_in(self, args: tuple) -> None:
        """Copy this call's inputs into the static buffers (a carried output lying on one copied aside first)."""
        if self.carried_over_inputs:
            args = tuple(a.clone() if isinstance(a, torch.Tensor) and storage_span(a)[0] in self.carried_over_inputs
                         else a for a in args)
        for static, a, p in zip(self.static_inputs, args, self.persistent):
            if not p and static.data_ptr() != a.data_ptr():
                static.copy_(a)

    def __call__(self, *args):
        if self.uncaptured:
            return tuple(self.fn(*args))
        if not self.warmed_up:
            self._check_inputs(args)
            self.warmed_up = True
            release_matmul_workspaces()  # idle ones of other streams are not held through the warm-up's peak
            return tuple(self.fn(*args))
        if self.graph is not None and self._persistent_moved(args):
            level, self.warned_moved = logging.INFO if self.warned_moved else logging.WARNING, True
            log.log(level, "spmd: capturing the %s graph as a CUDA graph again (capture #%d): a tensor it reads in "
                    "place moved to new storage: %s. Update parameters, buffers and optimizer state in place "
                    "(copy_) to keep the captured graph.", self.label, self.captures + 1, self._moved_inputs(args))
            self.graph = None
        if self.graph is None:
            self._capture(args)  # this call's inputs are the static ones, and the capture ran the step
            return tuple(self.fn(*args)) if self.uncaptured else self._outputs()
        self._copy_in(args)
        self.graph.replay()
        return self._outputs()
