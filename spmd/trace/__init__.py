"""Capture: the user's whole train step (forward, backward, optimizer step) as one pure aten graph.

``capture`` runs the step once on fake tensors and functionalizes it (``direct_functionalize`` when
the optimizer's writes are its only mutations); ``step_state`` lays out what the step owns (modules,
optimizers, their tensors) as the graph's inputs; ``user_objects`` leaves the user's objects as tracing
found them; ``host_reads`` refuses (or, for environment variables, names) the Python values a trace would
freeze (``random``, ``numpy.random``, clocks, ``.item()``) and ``side_effects`` replays the step's
prints, log records and counters on every call, naming once those it cannot replay, and
``scheduler_steps`` an lr scheduler's step called in the step after every call. What users already
have is traced through: ``torch.compile``d blocks and functions as their originals (``user_compiled``),
``torch.distributed.nn``'s collectives as functional ones (``dist_nn``), a flex_attention ``BlockMask``'s
tensors as inputs (``block_masks``). Random draws are eager's: a checkpoint's recompute reuses its
forward's (``checkpoint_rng``), and a dropout mask of a transposed activation is drawn in memory order
(``mask_layouts``). Hyperparameters enter as inputs through ``spmd.optim``, which the
tracer calls.
Hands the traced graph to ``spmd.parallel`` for expansion (``spmd.checks``' optimizer probe traces
each optimizer alone through it first).
"""

from .capture import trace_train_step, capture_train_step
from .step_state import StepState

__all__ = ["StepState", "capture_train_step", "trace_train_step"]
