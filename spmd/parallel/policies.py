"""Sharding units from FSDP wrap policies, with FSDP's semantics.

A policy picks the modules that become units (each gathers and reduce-scatters its
parameters as one). The kinds FSDP accepts:

* a ``_Policy`` object (``ModuleWrapPolicy``, ``CustomPolicy``): asked once with
  ``policy._run_policy(root, ignored_modules, root_kwargs)``, which returns the chosen
  modules (with per-module keyword overrides for ``CustomPolicy``);
* a callable (``size_based_auto_wrap_policy``, ``_or_policy``, partials of
  ``transformer_auto_wrap_policy`` or ``lambda_auto_wrap_policy``): asked bottom-up the way
  ``torch.distributed.fsdp.wrap._recursive_wrap`` asks it, with the number of parameters
  no inner unit claimed yet (FSDP's own traversal runs, with a recorder as the wrapper);
* a plain set (list, tuple) of module classes: ``ModuleWrapPolicy`` of those classes;
* ``None``: the root is the only unit.

The root is always a unit too (the last one). ``unit_modules`` returns the chosen
modules in post-order, the order in which FSDP applies ``fully_shard`` to them.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch.nn as nn
from torch.distributed.fsdp.wrap import _Policy, _recursive_wrap

WrapPolicy = Union[None, _Policy, Callable[..., bool], set, frozenset, list, tuple]


def _post_order(root: nn.Module) -> list[nn.Module]:
    """Every module under ``root`` (shared ones once), children before parents, as FSDP visits them."""
    seen, out = {root}, []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if child not in seen:
                seen.add(child)
                visit(child)
        out.append(module)

    visit(root)
    return out


def as_policy(policy: WrapPolicy) -> Union[None, _Policy, Callable[..., bool]]:
    """``policy`` in one of FSDP's forms (a plain collection of classes becomes ``ModuleWrapPolicy``)."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if isinstance(policy, (set, frozenset, list, tuple)):
        bad = [c for c in policy if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise TypeError(f"spmd: a wrap_policy given as a collection must hold nn.Module classes, got {bad}")
        return ModuleWrapPolicy(set(policy))
    if policy is None or isinstance(policy, _Policy) or callable(policy):
        return policy
    raise TypeError(
        f"spmd: wrap_policy must be an FSDP policy (ModuleWrapPolicy, CustomPolicy), a callable policy "
        f"(size_based_auto_wrap_policy, _or_policy, ...), a set of nn.Module classes or None; got {policy!r}"
    )


def unit_modules(root: nn.Module, policy: WrapPolicy) -> list[tuple[nn.Module, dict[str, Any]]]:
    """The modules that become units under ``policy`` (root excluded), post-order, each with its overrides.

    Overrides are the keyword dict a ``CustomPolicy`` returned for that module (else empty).
    """
    policy = as_policy(policy)
    if policy is None:
        return []
    if isinstance(policy, _Policy):
        chosen = policy._run_policy(root, set(), {})
        return [(m, dict(chosen[m])) for m in _post_order(root) if m in chosen and m is not root]
    chosen: list[nn.Module] = []

    def record(module: nn.Module, **_: Any) -> nn.Module:
        chosen.append(module)
        return module  # the tree stays as it is

    _recursive_wrap(root, auto_wrap_policy=policy, wrapper_cls=record, ignored_modules=set(),
                    ignored_params=set(), only_wrap_children=True)
    order = {m: i for i, m in enumerate(_post_order(root))}
    return [(m, {}) for m in sorted(set(chosen), key=order.__getitem__)]


def enclosing_units(root: nn.Module, units: list[nn.Module]) -> dict[nn.Module, list[nn.Module]]:
    """For every module under ``root``: the units whose subtree contains it, innermost first (root last)."""
    unit_set = set(units)
    out: dict[nn.Module, list[nn.Module]] = {}

    def visit(module: nn.Module, chain: list[nn.Module]) -> None:
        if module in out:
            return  # a shared module keeps the chain of its first path
        chain = [module, *chain] if module in unit_set else chain
        out[module] = chain
        for child in module.children():
            visit(child, chain)

    visit(root, [root])
    return out


def owning_unit(users: list[nn.Module], chains: dict[nn.Module, list[nn.Module]]) -> Optional[nn.Module]:
    """The innermost unit whose subtree holds every module in ``users`` (a tied parameter's owner)."""
    common = None
    for user in users:
        chain = chains[user]
        common = list(chain) if common is None else [u for u in common if u in chain]
    return common[0] if common else None
