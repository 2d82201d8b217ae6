"""Optimizer code written for Python numbers, given 0-dim hyperparameter tensors instead.

Some torch ops take a number where optimizer code passes a hyperparameter (``alpha=``,
``value=``, a foreach op's scalar, ``_foreach_lerp``'s weight). Handed a 0-dim tensor, they
would read it as a number (a data-dependent ``item()`` in a trace) or reject it.
``REWRITES`` maps each such op to a function that computes the same arithmetic with the
tensor as a tensor operand, as the op's kernel computes it; ``spmd.optim.hyperparams.HyperMode``
applies it (a rewrite returns ``NotImplemented`` where the call needs none).

One op becomes several, and each would round its result: for float16 and bfloat16 tensors
a rewrite runs the float32 kernel of the same arithmetic (``addcmul``, ``addcdiv``, ``lerp``,
whose multiply-adds are fused as the reduced-precision kernels fuse theirs) and rounds once,
as the kernel does with its number (a CPU ``add``/``sub`` kernel rounds its ``alpha`` to the
tensor's dtype first, and so does the CPU's foreach multiply by a number; CUDA's do not). A
foreach op on such lists stays foreach ops (the number as a 1-element float32 tensor per element,
which promotes them, and one foreach copy to round), so an optimizer's update remains one chain
that ``graph_utils.foreach_chains`` can cut by position.
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


_REDUCED = (torch.float16, torch.bfloat16)


def _reduced(*tensors) -> bool:
    """True for tensors of one reduced-precision dtype: their kernels compute in float32 and round once."""
    return all(isinstance(t, torch.Tensor) and t.dtype in _REDUCED and t.dtype == tensors[0].dtype for t in tensors)


def _opmath(scalar: torch.Tensor, like: torch.Tensor, cpu_rounds: bool = False) -> torch.Tensor:
    """``scalar`` as the kernel for reduced-precision ``like`` reads a Python number: as float32 (its
    compute type), on ``like``'s device; with ``cpu_rounds``, CPU kernels round it to ``like``'s dtype first
    (add's and sub's ``alpha``)."""
    if cpu_rounds and like.device.type == "cpu":
        scalar = scalar.to(like.dtype)
    return scalar.to(device=like.device, dtype=torch.float32)


def _rounded_once(func, target: torch.Tensor, value: torch.Tensor):
    """``value`` (computed in float32) rounded once to ``target``'s dtype; written into ``target`` if ``func`` is in place."""
    out = value.to(target.dtype)
    return target.copy_(out) if _inplace(func) else out


def _inplace(func) -> bool:
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def _each(func, results: list):
    """A foreach op's result from its per-element ``results`` (already written in place if ``func`` is in place)."""
    return None if _inplace(func) else results


def _alpha_reduced(func, a, b, alpha):
    """``a + alpha * b`` (``-`` for sub) for float16/bfloat16 ``a`` and ``b``, as their kernel: in float32
    (a multiply-add, as the float32 ``addcmul`` kernel fuses it), rounded once."""
    sign = -1 if "sub" in getattr(func, "__name__", "") else 1
    return _rounded_once(func, a, torch.addcmul(a.float(), b.float(), _opmath(alpha, a, cpu_rounds=True), value=sign))


def _multiply_add(func, a, b, alpha):
    """``a + alpha * b`` (``-`` for sub) as ``addcmul``, whose kernel fuses the multiply-add as ``add``'s
    does with a number (``a + (b * alpha)`` would round twice); float16/bfloat16: ``_alpha_reduced``."""
    if _reduced(a, b):
        return _alpha_reduced(func, a, b, alpha)
    sign = -1 if "sub" in getattr(func, "__name__", "") else 1
    scale = alpha.to(device=a.device, dtype=a.dtype)
    return a.addcmul_(b, scale, value=sign) if _inplace(func) else torch.addcmul(a, b, scale, value=sign)


def opmath_per_element(scalars, like: list) -> list:
    """``scalars`` (a 0-dim tensor, or one per element of ``like``) as float16/bfloat16 kernels read a
    number, in float32, as a 1-element float32 tensor per element on its device: not 0-dim, it
    promotes the element it meets, so one foreach op computes in float32 as those kernels do."""
    return torch._foreach_mul([torch.ones(1, dtype=torch.float32, device=t.device) for t in like], scalars)


def _foreach_alpha_reduced(func, xs: list, ys: list, alpha: torch.Tensor):
    """``_foreach_add(xs, ys, alpha=t)`` (``-`` for sub) for float16/bfloat16 lists as their kernels compute
    it (``_alpha_reduced``), in foreach ops, so an optimizer's update stays one foreach chain: ``t`` as a
    1-element float32 tensor per element (it promotes, so ``addcmul`` computes in float32 with one
    multiply-add), the result rounded once by a foreach copy."""
    sign = -1 if "sub" in getattr(func, "__name__", "") else 1
    scales = opmath_per_element(_opmath(alpha, xs[0], cpu_rounds=True), xs)
    values = torch._foreach_addcmul(xs, ys, scales, value=sign)
    out = xs if _inplace(func) else [torch.empty_like(x) for x in xs]
    torch._foreach_copy_(out, values)
    return None if _inplace(func) else out


def _floating_pair(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.is_floating_point()
            and a.dtype == b.dtype and b.shape == torch.broadcast_shapes(a.shape, b.shape) == a.shape)


def _alpha(func, args, kwargs):
    """``a.add(b, alpha=t)`` -> ``a + t * b`` computed as the kernel computes it, one fused multiply-add
    (``_multiply_add``; also sub, and the foreach list forms as ``_foreach_addcmul``); otherwise
    ``a.add(b * t)``."""
    alpha, args, kwargs = _split(args, kwargs, 2, "alpha")
    if not is_scalar_tensor(alpha) or len(args) < 2:
        return NotImplemented
    other = args[1]
    if not kwargs and len(args) == 2:
        if _floating_pair(args[0], other):
            return _multiply_add(func, args[0], other, alpha)
        if (isinstance(other, (list, tuple)) and isinstance(args[0], (list, tuple)) and len(other) == len(args[0])
                and all(_floating_pair(a, b) for a, b in zip(args[0], other))):
            if (all(_reduced(a, b) and a.dim() for a, b in zip(args[0], other))
                    and len({(a.dtype, a.device) for a in args[0]}) == 1):
                return _foreach_alpha_reduced(func, args[0], other, alpha)
            if any(_reduced(a) for a in args[0]):
                return _each(func, [_multiply_add(func, a, b, alpha) for a, b in zip(args[0], other)])
            addcmul = torch._foreach_addcmul_ if _inplace(func) else torch._foreach_addcmul
            sign = -1 if "sub" in getattr(func, "__name__", "") else 1
            return addcmul(args[0], other, _per_element(alpha, args[0], dtype=True), value=sign)
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
        if foreach and all(_reduced(*ts) for ts in zip(self_, t1, t2)):
            return _each(func, [_value_reduced(func, combine, *ts, value) for ts in zip(self_, t1, t2)])
        if not foreach and _reduced(self_, t1, t2):
            return _value_reduced(func, combine, self_, t1, t2, value)
        if foreach:
            term = combine(torch._foreach_mul(t1, value), t2)
            return (torch._foreach_add_ if inplace else torch._foreach_add)(self_, term)
        term = combine(t1 * value, t2)
        return self_.add_(term) if inplace else self_.add(term)

    return rewrite


_FLOAT_OP = {torch._foreach_mul: torch.addcmul, torch.mul: torch.addcmul, torch._foreach_div: torch.addcdiv,
             torch.div: torch.addcdiv}


def _value_reduced(func, combine, self_, t1, t2, value):
    """``self + (value * t1) <combine> t2`` for float16/bfloat16 tensors, as the kernel: the float32 kernel
    on ``value * t1`` (it fuses the multiply-add as theirs does), rounded once."""
    return _rounded_once(func, self_, _FLOAT_OP[combine](self_.float(), t1.float() * _opmath(value, self_), t2.float()))


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
    if not kwargs and all(_reduced(a, b) for a, b in zip(*args)):  # the kernel: float32, one rounding
        return _each(func, [_lerp_reduced(func, a, b, weight) for a, b in zip(*args)])
    return func(args[0], args[1], _per_element(weight, args[0], dtype=True), **kwargs)


def _lerp_reduced(func, a, b, weight):
    """``a.lerp(b, weight)`` for float16/bfloat16 tensors, as the kernel computes it: in float32, rounded once."""
    return _rounded_once(func, a, a.float().lerp(b.float(), _opmath(weight, a)))


def _lerp_weight(func, args, kwargs):
    """``a.lerp(b, t)`` with a 0-dim tensor weight, as the kernel computes it with a number: for float16 and
    bfloat16 in float32, rounded once (given a tensor weight, the kernel would round it to their dtype);
    otherwise with the weight in the tensors' dtype."""
    weight, args, kwargs = _split(args, kwargs, 2, "weight")
    if not is_scalar_tensor(weight) or len(args) != 2 or kwargs or not all(isinstance(t, torch.Tensor) for t in args):
        return NotImplemented
    a, b = args
    if _reduced(a, b):
        return _lerp_reduced(func, a, b, weight)
    if weight.dtype != a.dtype and a.is_floating_point():  # a number is read in the tensor's dtype
        return func(a, b, weight.to(device=a.device, dtype=a.dtype))
    return NotImplemented


def _foreach_scalar(func, args, kwargs):
    """A foreach op given a 0-dim tensor scalar -> its list form, that tensor at every position.

    (``_foreach_add(xs, t)`` would otherwise read ``t`` as a number; only mul and div keep a tensor.)
    """
    if len(args) < 2 or not is_scalar_tensor(args[1]) or not isinstance(args[0], (list, tuple)):
        return NotImplemented
    return func(args[0], _per_element(args[1], args[0]), *args[2:], **kwargs)


def _foreach_mul_scalar(func, args, kwargs):
    """``_foreach_mul(xs, t)`` with a 0-dim tensor ``t`` where eager passes a number: on the CPU, float16 and
    bfloat16 elements are multiplied by the number rounded to their dtype (the kernel of the number's
    overload rounds it; the tensor overload would compute with it in float32)."""
    if len(args) != 2 or kwargs or not is_scalar_tensor(args[1]) or not isinstance(args[0], (list, tuple)):
        return NotImplemented
    xs, scalar = args
    if not xs or not _reduced(*xs) or any(x.device.type != "cpu" for x in xs) or scalar.dtype == xs[0].dtype:
        return NotImplemented
    return func(xs, scalar.to(xs[0].dtype))


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


# Foreach ops whose 0-dim tensor scalar becomes one tensor per element (``_foreach_scalar``, ``_foreach_pow``)
_SCALAR_TO_LIST = ("add", "sub", "pow", "maximum", "minimum", "clamp_min", "clamp_max")


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
    table[torch._foreach_mul] = table[torch._foreach_mul_] = _foreach_mul_scalar
    table[torch.Tensor.lerp] = table[torch.Tensor.lerp_] = table[torch.lerp] = _lerp_weight
    for name in _SCALAR_TO_LIST:
        rewrite = {"add": _foreach_add_sub, "sub": _foreach_add_sub, "pow": _foreach_pow}.get(name, _foreach_scalar)
        for n in (f"_foreach_{name}", f"_foreach_{name}_"):
            if hasattr(torch, n):
                table[getattr(torch, n)] = rewrite
    return table


REWRITES = _rewrites()
# The List overloads (one tensor per element) that the rewrites make of foreach ops given a 0-dim tensor:
# on DTensor parameters each needs a DTensor sharding strategy (``spmd._torch_version.add_dtensor_list_strategies``).
LIST_FORMS = tuple(getattr(torch.ops.aten, n).List for name in ("lerp", *_SCALAR_TO_LIST)
                   for n in (f"_foreach_{name}", f"_foreach_{name}_") if hasattr(torch.ops.aten, n))
