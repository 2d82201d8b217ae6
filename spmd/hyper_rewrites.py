"""Optimizer code written for Python numbers, given 0-dim hyperparameter tensors instead.

Some torch ops take a number where optimizer code passes a hyperparameter (``alpha=``,
``value=``, a foreach op's scalar, ``_foreach_lerp``'s weight). Handed a 0-dim tensor, they
would read it as a number (a data-dependent ``item()`` in a trace) or reject it.
``REWRITES`` maps each such op to a function that computes the same arithmetic with the
tensor as a tensor operand, as the op's kernel computes it; ``spmd.hyperparams.HyperMode``
applies it (a rewrite returns ``NotImplemented`` where the call needs none).
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def is_scalar_tensor(v) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == 0



def _split(args, kwargs, position: int, name: str):
    """(value, args, kwargs without it) for the argument at ``position`` / keyword ``name``."""
    if name in kwargs:
        rest = dict(kwargs)
        return rest.pop(name), tuple(args), rest
    if len(args) > position:
        return args[position], tuple(args[:position]) + tuple(args[position + 1:]), dict(kwargs)
    return None, tuple(args), dict(kwargs)


def _alpha(func, args, kwargs):
    """``a.add(b, alpha=t)`` -> ``a.add(b * t)`` (also sub, and the foreach list forms)."""
    alpha, args, kwargs = _split(args, kwargs, 2, "alpha")
    if not is_scalar_tensor(alpha) or len(args) < 2:
        return NotImplemented
    other = args[1]
    if isinstance(other, (list, tuple)):
        scaled = torch._foreach_mul(other, alpha)
    elif isinstance(other, torch.Tensor):
        scaled = other * alpha
    else:
        return NotImplemented
    return func(args[0], scaled, *args[2:], **kwargs)


def _elementwise_value(combine: Callable, inplace: bool, foreach: bool) -> Callable:
    """``addcmul``/``addcdiv`` with a 0-dim tensor ``value``: ``self + (value * t1) <op> t2``, as the kernels compute."""

    def rewrite(func, args, kwargs):
        value, args, kwargs = _split(args, kwargs, 3, "value")
        if foreach and value is None:
            value, args, kwargs = _split(args, kwargs, 3, "scalars")
        if not is_scalar_tensor(value) or len(args) != 3 or kwargs:
            return NotImplemented
        self_, t1, t2 = args
        if foreach:
            term = combine(torch._foreach_mul(t1, value), t2)
            return (torch._foreach_add_ if inplace else torch._foreach_add)(self_, term)
        term = combine(t1 * value, t2)
        return self_.add_(term) if inplace else self_.add(term)

    return rewrite


def _per_element(scalar: torch.Tensor, like: list, dtype: bool = False) -> list:
    """``scalar`` once for each element of ``like``, moved to (and with ``dtype``: cast to) that element's
    device and dtype, each distinct conversion made once."""
    made: dict = {}

    def convert(t):
        key = (t.device, t.dtype if dtype else scalar.dtype)
        if key not in made:
            made[key] = scalar if key == (scalar.device, scalar.dtype) else scalar.to(device=key[0], dtype=key[1])
        return made[key]

    return [convert(t) if isinstance(t, torch.Tensor) else scalar for t in like]


def _foreach_weight(func, args, kwargs):
    """``_foreach_lerp(a, b, t)`` with a 0-dim tensor weight -> the list form, one weight per element."""
    weight, args, kwargs = _split(args, kwargs, 2, "weight")
    if not is_scalar_tensor(weight) or len(args) != 2:
        return NotImplemented
    return func(args[0], args[1], _per_element(weight, args[0], dtype=True), **kwargs)


def _foreach_scalar(func, args, kwargs):
    """A foreach op given a 0-dim tensor scalar -> its list form, that tensor at every position.

    (``_foreach_add(xs, t)`` would otherwise read ``t`` as a number; only mul and div keep a tensor.)
    """
    if len(args) < 2 or not is_scalar_tensor(args[1]) or not isinstance(args[0], (list, tuple)):
        return NotImplemented
    return func(args[0], _per_element(args[1], args[0]), *args[2:], **kwargs)


def _foreach_add_sub(func, args, kwargs):
    """``_foreach_add``/``_foreach_sub`` with a 0-dim tensor ``alpha`` or scalar."""
    if len(args) > 2 or "alpha" in kwargs:
        return _alpha(func, args, kwargs)
    return _foreach_scalar(func, args, kwargs)


def _foreach_pow(func, args, kwargs):
    """``_foreach_pow(t, xs)`` -> ``_foreach_pow([t] * n, xs)``; ``_foreach_pow(xs, t)`` -> its list form."""
    if len(args) == 2 and is_scalar_tensor(args[0]) and isinstance(args[1], (list, tuple)) and not kwargs:
        return func(_per_element(args[0], args[1]), args[1])
    return _foreach_scalar(func, args, kwargs)


def _rewrites() -> dict[Any, Callable]:
    table: dict[Any, Callable] = {}
    for name in ("add", "add_", "sub", "sub_"):
        for owner in (torch.Tensor, torch):
            if hasattr(owner, name):
                table[getattr(owner, name)] = _alpha
    for name, combine in (("addcmul", torch.mul), ("addcdiv", torch.div)):
        for inplace in (False, True):
            n = name + ("_" if inplace else "")
            for owner in (torch.Tensor, torch):
                if hasattr(owner, n):
                    table[getattr(owner, n)] = _elementwise_value(combine, inplace, foreach=False)
        fcombine = torch._foreach_mul if combine is torch.mul else torch._foreach_div
        table[torch._foreach_addcmul if name == "addcmul" else torch._foreach_addcdiv] = \
            _elementwise_value(fcombine, False, foreach=True)
        table[torch._foreach_addcmul_ if name == "addcmul" else torch._foreach_addcdiv_] = \
            _elementwise_value(fcombine, True, foreach=True)
    table[torch._foreach_lerp] = table[torch._foreach_lerp_] = _foreach_weight
    for name in ("add", "sub", "pow", "maximum", "minimum", "clamp_min", "clamp_max"):
        rewrite = {"add": _foreach_add_sub, "sub": _foreach_add_sub, "pow": _foreach_pow}.get(name, _foreach_scalar)
        for n in (f"_foreach_{name}", f"_foreach_{name}_"):
            if hasattr(torch, n):
                table[getattr(torch, n)] = rewrite
    return table


REWRITES = _rewrites()
