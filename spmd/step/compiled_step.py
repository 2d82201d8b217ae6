"""One compiled signature of a train step (``CompiledStep``) and what a repeated call reuses of it.

A ``CompiledStep`` is the last stage (``spmd.step.stages``): ``Transformed.lower`` made it, every graph of
its runner compiled for the first call's inputs before that call runs; from then on calls only run it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..trace.accumulation import GradPlan
from ..trace.step_state import StepState
from .iter_graph_module import IterGraphModule
from .state_check import StateCheck
from .value_watch import ValueWatch


@dataclass
class CompiledStep:
    """One cache entry: the runnable graph and how to map the step's inputs onto it."""

    runner: Callable
    out_spec: pytree.TreeSpec
    # the expanded graph, before the user transformation, or what rebuilds it when first read (``graph``)
    graph_source: Union[fx.GraphModule, Callable[[], fx.GraphModule]]
    hyper_tensors: list[torch.Tensor] = field(default_factory=list)  # kept across calls: CUDA graphs read them in place
    hyper_values: list[float] = field(default_factory=list)
    group_values: list[float] = field(default_factory=list)  # the groups' values this call (not first_step's)
    first_step: dict[int, float] = field(default_factory=dict)  # hyper slot -> its value for the first run only
    compile_times: dict[str, float] = field(default_factory=dict)  # phase -> seconds (spmd.compile_times)
    report: Any = None  # what the ranks compare before it runs (rank_check.RankReport), made once
    # (zero_grads_for, grad_order) -> this step with zero gradients where other ranks compute one
    # (spmd.checks.rank_agreement); each variant is traced once, when the ranks first need it
    variants: dict[tuple, "CompiledStep"] = field(default_factory=dict)
    grads: GradPlan = field(default_factory=GradPlan)  # gradients taken and left (spmd.trace.accumulation)
    dtensors: dict = field(default_factory=dict)  # output position -> DTensor spec (spmd.trace.step_outputs)
    live: dict = field(default_factory=dict)  # output position -> the state's tensor it returns (step_outputs)
    cache_digest: Optional[str] = None  # its key in the compile cache (``spmd.step.cache_key``), where it has one
    # Python side effects run after each call but the first (side_effects); an lr scheduler's step after every call
    replays: list = field(default_factory=list)
    watch: Optional[ValueWatch] = None  # the Python values its trace read (``spmd.step.value_watch``)
    lowered: bool = False  # ``Transformed.lower`` made it: calls only run ``runner``
    ran: bool = False  # a call ran it to the end (``first_step`` is then used up)
    kept_in: Any = None  # where its code is kept (``spmd.step.step_cache.KeptIn``), told once it ran
    # the optimizer state created for its trace, released until read on the first run (``spmd.lower.unread_state``)
    created_state: list = field(default_factory=list)

    @property
    def graph(self) -> fx.GraphModule:
        """The expanded graph (built on first read where ``graph_source`` builds it)."""
        if not isinstance(self.graph_source, fx.GraphModule):
            self.graph_source = self.graph_source()
        return self.graph_source

    @property
    def cuda_graph_captures(self) -> int:
        """How many CUDA graph captures its graphs (and its variants') made so far; 0 without CUDA graphs."""
        own = self.runner.cuda_graph_captures if isinstance(self.runner, IterGraphModule) else 0
        return own + sum(v.cuda_graph_captures for v in self.variants.values())

    def hyper_inputs(self, values: list[float], state: Optional[StepState] = None) -> list[torch.Tensor]:
        """The graph's hyperparameter inputs holding ``values`` (``StepState.hyper_values()``), refilled
        in place only where a value changed; until a call ran the step, ``first_step``'s values where
        it has them. ``state`` makes the tensors when the entry has none yet."""
        self.group_values = values  # what the step reads in its groups (a returned one: ``step_outputs.HyperOutput``)
        if self.first_step and not self.ran:
            values = [self.first_step.get(i, v) for i, v in enumerate(values)]
        if values != self.hyper_values:
            if not self.hyper_tensors:
                self.hyper_tensors = state.hyper_tensors()
                self.hyper_values = [float("nan")] * len(values)
            for tensor, old, new in zip(self.hyper_tensors, self.hyper_values, values):
                if old != new:
                    tensor.fill_(new)
            self.hyper_values = values
        return self.hyper_tensors

    def finished_run(self) -> None:
        """Called after a call ran the step: the first step's values are used up, and the compile cache keeps
        what the run autotuned (``KeptIn.after_first_run``)."""
        self.ran = True
        self.first_step = {}
        self.created_state = []
        if self.kept_in is not None:
            kept_in, self.kept_in = self.kept_in, None
            kept_in.after_first_run(self.runner)

    def flush(self) -> None:
        """Run the work this graph deferred to its next iteration, if any (no next iteration follows)."""
        if isinstance(self.runner, IterGraphModule) and self.runner.pending:
            with torch.no_grad():
                self.runner.flush()


@dataclass
class LastCall:
    """A call ``CallPath.repeat_last_call`` (``spmd.step.call_path``) can recognise again: the entry it ran, the
    structure and leaf signatures of its arguments, what the step reached besides them (weak references,
    compared by identity, ``spmd.trace.step_reach``), and a ``StateCheck`` of its modules and optimizers."""

    entry: CompiledStep
    spec: pytree.TreeSpec
    leaf_signatures: list
    reached: list
    check: StateCheck
    ambient: dict  # the torch settings around it (``spmd.step.dependencies.ambient``)


def first_step_slots(state: StepState, created: list) -> dict[int, float]:
    """Hyperparameter slot -> the value the first run uses, for state created by ``ensure_optimizer_state``."""
    index = {id(o): i for i, o in enumerate(state.optimizers)}
    wanted = {(index[id(c.optim)], g, key): v for c in created for (g, key), v in c.first_step.items()}
    return {k: wanted[(s.optim, s.group, s.key)] for k, s in enumerate(state.hyper_slots)
            if (s.optim, s.group, s.key) in wanted}


def undo_created(created: list) -> None:
    """Remove the optimizer state created for a trace (``spmd.optim.state.CreatedState``)."""
    for made in created:
        made.undo()
