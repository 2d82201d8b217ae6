"""What the traces of a compiled step assumed about hyperparameter values, stored beside it in the cache.

What a trace learned about hyperparameter values (``spmd.optim.hyperparams``: the outcome of
``momentum != 0``, a value a fused kernel takes as a number) is not in the step's key
(``spmd.step.cache_key``): it is known only after some trace in this process ran, so a key holding it
would differ between a fresh process and one that traced before. ``hyper_guards`` gives those facts for
a state as a value to store beside a compiled entry, ``guards_hold`` tells whether a later state meets
them (a persistent cache looks up the key, then takes the entry whose guards hold), and
``restore_hyper_guards`` makes a process that loads an entry know them, as if it had traced it.
"""

from __future__ import annotations

from ..optim.hyperparams import assumptions, Learned, learned, learned_facts
from ..trace.step_state import StepState


def hyper_guards(state: StepState) -> dict:
    """What the traces so far assumed about ``state``'s hyperparameter values, as a JSON value to store
    beside a compiled entry, per param group (``"0.1"``: optimizer 0, group 1): the guards
    (``momentum ne 0.0``) and specialised values (an ``lr`` a fused kernel takes as a number), and
    what they are now (``spmd.optim.hyperparams.assumptions``)."""
    out = {}
    for o, optim in enumerate(state.optimizers):
        for g, group in enumerate(optim.param_groups):
            facts = learned_facts(optim, group)
            if facts is not None and (facts.guards or facts.specialised):
                out[f"{o}.{g}"] = {"guards": sorted(map(list, facts.guards), key=repr),
                                   "specialised": sorted(map(list, facts.specialised), key=repr),
                                   "assumed": assumptions(group, facts)}
    return out


def guards_hold(guards: dict, state: StepState) -> bool:
    """Whether ``state``'s hyperparameter values meet ``guards`` (``hyper_guards`` of the state an entry was
    compiled for, possibly in another process): each guard has the same outcome, each specialised value
    is the same."""
    for where, facts in guards.items():
        o, g = map(int, where.split("."))
        if o >= len(state.optimizers) or g >= len(state.optimizers[o].param_groups):
            return False
        learned = Learned({tuple(x) for x in facts["guards"]}, {tuple(x) for x in facts["specialised"]})
        if assumptions(state.optimizers[o].param_groups[g], learned) != facts["assumed"]:
            return False
    return True


def restore_hyper_guards(guards: dict, state: StepState) -> None:
    """Make this process know what ``guards`` (``hyper_guards`` of a stored entry) assume, as if it had
    traced the entry itself: later signatures then retrace when a guarded or specialised value changes."""
    for where, facts in guards.items():
        o, g = map(int, where.split("."))
        optim = state.optimizers[o]
        known = learned(optim, optim.param_groups[g])
        known.guards |= {tuple(x) for x in facts["guards"]}
        known.specialised |= {tuple(x) for x in facts["specialised"]}


__all__ = ["guards_hold", "hyper_guards", "restore_hyper_guards"]
