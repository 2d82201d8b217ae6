"""Refuse before anything runs. ``optimizer_probe``: before a step's first trace, trace each of its
optimizers alone (through ``spmd.trace``) and compare one update with eager's, so an optimizer is
traced only where its traced update equals eager's. ``rank_check``: read an expanded graph's
collectives into a report that is the same on every rank that will issue the same ones;
``rank_agreement``: the ranks compare those reports before every call. ``step_inputs``: a step's inputs
and its transformation's result, refused before anything is traced or cached.
A step that passes goes on to ``spmd.parallel`` (expansion) and, on every call, to the runner
(``spmd.api`` with ``spmd.step``).
"""

from .optimizer_probe import check_optimizers

__all__ = ["check_optimizers"]
