"""The per-call machinery of one compiled step (``CallPath``): recognise a repeated call cheaply, else look
its signature up among the compiled steps (compiling a new one through ``spmd.step.definition``), let the
ranks agree on what runs (``spmd.checks.rank_agreement``), and keep the most recently used compiled steps.
Hands ``spmd.api`` the compiled step and its graph inputs; the step only runs them.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.utils._pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from ..checks import rank_agreement
from ..compile_times import phase, recording
from ..trace.block_masks import is_block_mask, lift
from ..trace.step_reach import Reach, reach
from ..trace.step_state import describe_changes, find_modules_and_optimizers, local_tensor
from .call_signature import Signatures
from .compiled_step import CompiledStep, LastCall, undo_created
from .definition import StepDefinition
from .dependencies import ambient
from .state_check import StateCheck

log = logging.getLogger(__name__)


class CallPath:
    """What one compiled step does on every call before its graphs run. ``cache``: the compiled steps by
    signature, the ``options.cache_size`` most recently used; ``trace_count``: how many it compiled."""

    def __init__(self, definition: StepDefinition):
        self.definition = definition
        self.signatures = Signatures()
        self.cache: OrderedDict[tuple, CompiledStep] = OrderedDict()
        self.trace_count = 0
        self.evicted_captures = 0  # CUDA graph captures of entries dropped from ``cache``
        self.prepared = WeakIdKeyDictionary()  # parameters and buffers the parallel mode prepared, by identity
        self.last_compiled: Optional[CompiledStep] = None
        self.last_signature: Optional[dict[str, Any]] = None
        self.last_run: Optional[CompiledStep] = None
        self.last_call: Optional[LastCall] = None  # what the last call saw, to recognise a repeat cheaply
        # Before every call the ranks agree on the graph they run. None: where the step's group has several
        # ranks; True / False: on a group of one too / never, to measure (``spmd._testing.agree_across_ranks``).
        self.agree_across_ranks: Optional[bool] = None
        self._agreement: Optional[rank_agreement.Agreement] = None
        self._agreement_resolved = False
        self._stale: Optional[str] = None  # what changed of the values the last entry's trace read
        self._number_retraces: dict[str, int] = {}  # number argument (``input 3``) -> retraces for a new value

    def prepare_call(self, args: tuple, kwargs: dict) -> tuple[CompiledStep, list, list]:
        """(compiled step, its graph inputs, the state's tensors: parameters, buffers, optimizer state, in graph
        order) for a call with these arguments: the step found (a repeated call), or looked up and compiled."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if any(map(is_block_mask, leaves)):  # a flex_attention mask: its tensors are inputs (spmd.trace.block_masks)
            args, kwargs = lift(args, kwargs)
            leaves, spec = pytree.tree_flatten((args, kwargs))
        reached = reach(self.definition.fn, args, kwargs, leaves)  # what the step depends on besides its arguments
        group = self.agreement_group(args, kwargs)
        found = self.repeat_last_call(leaves, spec, reached)
        compared = found is not None and group is not None and not rank_agreement.agreed(found[0], group)
        if found is None or compared:  # a rank that runs another graph this call: compare in detail
            found = self.look_up(args, kwargs, leaves, spec, reached, group, compared)
        entry, flat, owned = found
        flat += [local_tensor(t) for t in leaves if isinstance(t, torch.Tensor)]
        if entry.grads:
            flat += entry.grads.entry_grads(owned)
        return entry, flat, owned

    def repeat_last_call(self, leaves: list, spec: pytree.TreeSpec, reached: Reach
                         ) -> Optional[tuple[CompiledStep, list, list]]:
        """(entry, graph inputs before the user's tensors, the state's tensors) when this call has the last call's
        signature, else None: the same argument structure and leaf signatures (so the same modules
        and optimizers), the same objects reached besides (``spmd.trace.step_reach``), the same torch settings
        around it (``ambient``), nothing changed in their state (``StateCheck``) nor in the Python values its
        trace read (``ValueWatch``)."""
        last = self.last_call
        if last is None or spec != last.spec or last.entry is not self.last_run or ambient() != last.ambient:
            return None
        if last.entry.watch is not None and last.entry.watch.changed():
            return None  # look_up names what changed and traces again
        if list(map(self.signatures.leaf, leaves)) != last.leaf_signatures:
            return None
        objects = reached.objects()
        if len(objects) != len(last.reached) or any(ref() is not o for ref, o in zip(last.reached, objects)):
            return None
        values = last.check.hypers_if_unchanged()
        if values is None:
            return None
        return last.entry, [*last.check.flat, *last.entry.hyper_inputs(values)], last.check.owned

    def look_up(self, args: tuple, kwargs: dict, leaves: list, spec: pytree.TreeSpec, reached: Reach,
                group: Optional[rank_agreement.Agreement] = None, compared: bool = False
                ) -> tuple[CompiledStep, list, list]:
        """(entry, graph inputs before the user's tensors, the state's tensors), from
        the full signature: the cached entry, or a new one compiled. With ``group``, the ranks then
        agree on what runs (``agree``; ``compared``: they already found that they differ), this rank
        taking part even when its own lookup or trace failed. Prepares new parameters and buffers (a
        new module's, a swapped-in submodule's) for their first run. Remembers the call for
        ``repeat_last_call`` when it ran the last call's entry and did not follow a failed check (a
        state that changes on every call would pay for a check on every call)."""
        definition = self.definition
        missed, self.last_call = self.last_call is not None, None
        created, times = [], {}
        try:
            state = definition.prepare_state(args, kwargs, reached)
            signature = self.signatures.of(state, args, kwargs)
            key = tuple(signature.items())
            candidate = rank_agreement.Candidate(self.cache.get(key), state)
            stale = candidate.entry is not None and candidate.entry.watch is not None and candidate.entry.watch.changed()
            if stale:  # a Python value its trace read changed: that trace no longer describes the step
                candidate = rank_agreement.Candidate(None, state)
                self._stale = stale
            if candidate.entry is None:
                state = definition.parallel_mode.prepare(state) or state  # a mode may replace parameters
                entry, state, created = definition.compile(state, args, kwargs)
                changes = describe_changes(self.last_signature, signature) if self.last_signature else []
                changes += [stale] if stale else []
                candidate = rank_agreement.Candidate(entry, state, fresh=True, retraced="; ".join(changes))
        except Exception as err:
            if group is None:
                raise
            candidate = rank_agreement.Candidate(error=err)
        agreed = candidate if group is None else self.agree(candidate, group, compared, created, args, kwargs, times)
        if candidate.fresh:
            looked_up, signature = signature, self.signatures.of(candidate.state, args, kwargs)  # compiling may
            candidate.entry.compile_times.update(times)  # have created state (after optim.state.clear())
            self.remember(tuple(signature.items()), candidate.entry, signature, looked_up)
        else:
            self.cache.move_to_end(key)
        entry, state = agreed.entry, agreed.state
        missed = missed or entry is not candidate.entry  # a variant: the entry is posted first again next call
        repeated = self.last_run is entry
        if self.last_run is not None and not repeated:
            self.last_run.flush()  # its deferred updates land before another graph runs
        self.last_run = entry
        new_tensors = [t for t in (*state.params, *state.buffers) if t not in self.prepared]
        if new_tensors:
            definition.parallel_mode.before_first_run(state, new_tensors)
            self.prepared.update(dict.fromkeys(new_tensors, True))
        hypers = entry.hyper_inputs(state.hyper_values(), state)
        if not repeated or missed:  # check the next call only after the same entry twice, and no failed check
            return entry, [*state.flat_tensors(), *hypers], state.owned_tensors()
        check = StateCheck(state, on_free=self.forget_last_call)
        self.last_call = LastCall(entry, spec, list(map(self.signatures.leaf, leaves)),
                                  [weakref.ref(o) for o in reached.objects()], check, ambient())
        return entry, [*check.flat, *hypers], check.owned

    def forget_last_call(self, _freed: Any = None) -> None:
        """Drop ``last_call`` (its tensors with it): one of its modules or optimizers was freed."""
        self.last_call = None

    def agree(self, candidate: rank_agreement.Candidate, group: rank_agreement.Agreement, compared: bool,
              created: list, args: tuple, kwargs: dict, times: dict) -> rank_agreement.Candidate:
        """What every rank runs this call (``rank_agreement.agree``), or the same error on every rank.

        When ranks differ only in which parameters get a gradient, this rank, if it lacks one,
        runs a variant of its entry that reduces a zero gradient for them in the common order
        (``rank_check.zero_gradient_plan``), compiled once per plan and kept with the entry
        (``ZeroGradVariants``). The entry itself stays what is posted first on every call: a parameter
        no rank uses gets no gradient, as under DDP. On an error, the optimizer state created for this
        call's compiles (``created``) is removed again.
        """
        variants = ZeroGradVariants(self.definition, candidate, args, kwargs, created)
        try:
            with recording(times), phase("rank_check"):
                return rank_agreement.agree(group, candidate, variants.compile, compared)
        except BaseException:
            undo_created(created)
            raise

    def agreement_group(self, args: tuple, kwargs: dict) -> Optional[rank_agreement.Agreement]:
        """Where this step's ranks agree before every call (``spmd.checks.rank_agreement``: a gloo group, and
        over a multi-dimensional mesh which of its ranks compare which collectives), or None (one rank, or
        ``agree_across_ranks=False``); made on the first call, from the modules it is called with."""
        if not self._agreement_resolved:
            wanted, definition = self.agree_across_ranks, self.definition
            modules = find_modules_and_optimizers(reach(definition.fn, args, kwargs))[0] if wanted is not False else []
            self._agreement = None if wanted is False else rank_agreement.agreement_for(
                definition.parallel_mode, modules, on_one_rank=bool(wanted))
            self._agreement_resolved = True
        return self._agreement

    def _warn_changing_numbers(self, looked_up: dict[str, Any]) -> None:
        """Warn once for a Python number argument that a second retrace is for a new value of (an annealed loss
        weight, a step count passed in): each value is a graph of its own, compiled anew."""
        for input_name, value in looked_up.items():
            before = self.last_signature.get(input_name)
            if not input_name.startswith("input ") or before == value or not (_number(before) and _number(value)):
                continue
            self._number_retraces[input_name] = self._number_retraces.get(input_name, 0) + 1
            if self._number_retraces[input_name] == 2:
                warnings.warn(
                    f"spmd.compile: {self.definition.name} was traced again for a new value of {input_name}, a "
                    f"Python number argument ({before} -> {value}), the second time: each value is a graph of its "
                    "own, traced and compiled anew. If it changes from call to call (an annealed loss weight, a "
                    "step count), pass it as a 0-dim tensor (torch.tensor(value)), which the compiled step reads "
                    "on every call, or use it outside the step.", RuntimeWarning, stacklevel=6)

    def remember(self, key: tuple, entry: CompiledStep, signature: dict[str, Any], looked_up: dict[str, Any]) -> None:
        """Cache ``entry`` under ``signature``, count the trace, and say why the step retraced (warning once when
        it keeps doing so): what differs between the last signature and the one the call was looked up by
        (``looked_up``, before compiling created any state); the least recently used entries beyond
        ``options.cache_size`` are dropped."""
        options, name = self.definition.options, self.definition.name
        self.trace_count += 1
        stale, self._stale = self._stale, None
        if self.last_signature is not None:
            changes = describe_changes(self.last_signature, looked_up) + ([stale] if stale else [])
            changes = changes or ["nothing in its signature"]
            # gradients held on entry or not: an accumulation loop's expected second graph (spmd.trace.accumulation)
            level = logging.INFO if all(c.startswith("gradient of ") for c in changes) else logging.WARNING
            log.log(level, "spmd.compile: %s retraced (trace %d): %s", name, self.trace_count, "; ".join(changes))
            self._warn_changing_numbers(looked_up)
            if self.trace_count == options.retrace_warning_at:
                warnings.warn(
                    f"spmd.compile: {name} has been traced {self.trace_count} times; each trace costs "
                    f"seconds. The last retrace was for: {'; '.join(changes)}. Keep what the step specialises "
                    "on fixed between calls (e.g. pad batches to one shape), or pass changing values as tensors.",
                    RuntimeWarning, stacklevel=5)
        self.last_signature = signature
        self.last_compiled = entry
        self.cache[key] = entry
        while len(self.cache) > options.cache_size:
            _, evicted = self.cache.popitem(last=False)
            evicted.flush()
            self.evicted_captures += evicted.cuda_graph_captures


@dataclass(frozen=True)
class ZeroGradVariants:
    """The variants of ``candidate``'s entry with zero gradients for parameters other ranks train
    (``rank_agreement.agree`` asks ``compile``); each is compiled once per plan, not through the compile
    cache, and kept in ``CompiledStep.variants``; optimizer state created for one goes to ``created``."""

    definition: StepDefinition
    candidate: rank_agreement.Candidate
    args: tuple
    kwargs: dict
    created: list

    def compile(self, zero_grads_for: frozenset, grad_order: list) -> rank_agreement.Candidate:
        plain = self.candidate.entry
        variant = plain.variants.get((zero_grads_for, tuple(grad_order)))
        if variant is not None:
            return rank_agreement.Candidate(variant, self.candidate.state)
        try:
            variant, state, new = self.definition.compile(self.candidate.state, self.args, self.kwargs, cached=False,
                                                          zero_grads_for=zero_grads_for, grad_order=grad_order)
        except Exception as err:  # the other ranks learn of it, then it is raised here
            return rank_agreement.Candidate(error=err)
        self.created.extend(new)
        if not variant.first_step:  # the variant runs first, on the state the entry's trace created
            variant.first_step, plain.first_step = plain.first_step, {}
        plain.variants[(zero_grads_for, tuple(grad_order))] = variant
        return rank_agreement.Candidate(variant, state, fresh=True)


def _number(text: Any) -> bool:
    """Whether a signature's value is that of an int or float argument (its repr)."""
    if not isinstance(text, str) or text in ("True", "False", "None"):
        return False
    try:
        float(text)
    except ValueError:
        return False
    return True
