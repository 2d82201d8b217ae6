"""Foreach Adam, AdamW and SGD traced in eager's own arrangement of the update.

Eager's foreach Adam without ``capturable`` computes its bias corrections and step sizes per
parameter as Python numbers (float64) and hands them to the foreach kernels as scalars. Torch's
code refuses tensor hyperparameters on that path, and its capturable path, which takes them,
arranges the update otherwise (the step size folded into the denominator, the second moment's
``1 - beta2`` applied by a separate multiply), so a float16 or bfloat16 parameter rounds
differently from eager's. ``multi_tensor_adam`` computes eager's arrangement on tensors:

* the per-parameter scalars as lists of 0-dim float64 tensors made by foreach ops from the step
  counters, so the whole update stays one chain of foreach ops that
  ``graph_utils.foreach_chains`` can cut by position;
* each op on the parameters and the state as eager's kernel computes it with those scalars
  (``spmd.optim.hyper_rewrites`` turns a 0-dim tensor where a number belongs into the same
  arithmetic).

Foreach SGD, traced under torch's compiling flag, multiplies the gradients by a tensor lr and
adds the product (two roundings); eager adds them with ``alpha=-lr`` (one).
``multi_tensor_sgd`` runs torch's own function with the flag off, so it takes eager's branch.

While ``HyperMode`` is active (inside a traced ``Optimizer.step``) ``torch.optim.adam`` and
``torch.optim.sgd`` run these in place of their ``_multi_tensor_*`` functions (``eager_foreach``);
Adam's only for the groups traced with ``capturable=EAGER_FOREACH`` (``traced_capturable`` in
``spmd.optim.hyperparams``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Iterator

import torch
from torch.optim.optimizer import _view_as_real
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from .hyper_rewrites import opmath_per_element

_REDUCED = (torch.float16, torch.bfloat16)


class _EagerForeach:
    """The ``capturable`` flag of a foreach Adam group traced in eager's non-capturable arrangement.

    Truthy, so torch's checks take the group's tensor hyperparameters (its non-capturable
    foreach path refuses a tensor lr), and recognised by ``multi_tensor_adam``, which then
    computes what eager's non-capturable step computes.
    """

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "EAGER_FOREACH"


EAGER_FOREACH = _EagerForeach()


def multi_tensor_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, grad_scale=None,
                      found_inf=None, *, amsgrad, has_complex, beta1, beta2, lr, weight_decay, eps, maximize,
                      capturable, differentiable, decoupled_weight_decay=False, torch_impl=None):
    """``torch.optim.adam._multi_tensor_adam`` for a group traced with ``capturable=EAGER_FOREACH``, in
    eager's non-capturable arrangement with tensor hyperparameters; any other call goes to
    ``torch_impl`` (torch's own function)."""
    if capturable is not EAGER_FOREACH or differentiable or grad_scale is not None or found_inf is not None:
        return torch_impl(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, grad_scale, found_inf,
                          amsgrad=amsgrad, has_complex=has_complex, beta1=beta1, beta2=beta2, lr=lr,
                          weight_decay=weight_decay, eps=eps, maximize=maximize, capturable=capturable,
                          differentiable=differentiable, decoupled_weight_decay=decoupled_weight_decay)
    if not params:
        return None
    # by device and dtype, as eager groups them (under the compiling flag torch's helper makes one group)
    grouped = _group_tensors_by_device_and_dtype([params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps])
    for (device_params, device_grads, device_exp_avgs, device_exp_avg_sqs, device_max_exp_avg_sqs,
         device_steps), _ in grouped.values():
        if has_complex:
            _view_as_real(device_params, device_grads, device_exp_avgs, device_exp_avg_sqs,
                          *([device_max_exp_avg_sqs] if amsgrad else []))
        if maximize:
            device_grads = torch._foreach_neg(device_grads)
        torch._foreach_add_(device_steps, 1)
        if weight_decay != 0:
            if decoupled_weight_decay:
                torch._foreach_mul_(device_params, 1 - lr * weight_decay)
            elif maximize:
                torch._foreach_add_(device_grads, device_params, alpha=weight_decay)
            else:
                device_grads = torch._foreach_add(device_grads, device_params, alpha=weight_decay)
        torch._foreach_lerp_(device_exp_avgs, device_grads, 1 - beta1)
        torch._foreach_mul_(device_exp_avg_sqs, beta2)
        _addcmul_value_(device_exp_avg_sqs, device_grads, device_grads, 1 - beta2)
        # eager: step_size = lr / (1 - beta1 ** step) * -1, the same number as lr / (beta1 ** step - 1)
        n = len(device_steps)
        neg_step_size = torch._foreach_div([lr] * n, torch._foreach_sub(torch._foreach_pow(beta1, device_steps), 1))
        # eager: (1 - beta2 ** step) ** 0.5; x ** 0.5 is sqrt(x) (torch computes it so)
        bias_correction2_sqrt = torch._foreach_sqrt(
            torch._foreach_neg(torch._foreach_sub(torch._foreach_pow(beta2, device_steps), 1)))
        if amsgrad:
            torch._foreach_maximum_(device_max_exp_avg_sqs, device_exp_avg_sqs)
            denom = torch._foreach_sqrt(device_max_exp_avg_sqs)
        else:
            denom = torch._foreach_sqrt(device_exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        _addcdiv_scalars_(device_params, device_exp_avgs, denom, neg_step_size)
    return None


def _reduced(tensors: list) -> bool:
    return bool(tensors) and tensors[0].dtype in _REDUCED


def _scale(tensors: list, scalars: list):
    """``tensors`` times ``scalars`` (one 0-dim tensor per element) as the first step of eager's
    ``addcmul``/``addcdiv`` kernels computes it, or None where that takes one op per element (a
    float16/bfloat16 0-dim element, whose product would not keep its shape). float16/bfloat16: the
    product in float32 (``opmath_per_element``), which the next op rounds once."""
    if not _reduced(tensors):
        return torch._foreach_mul(tensors, scalars)
    if any(t.dim() == 0 for t in tensors):
        return None
    return torch._foreach_mul(tensors, opmath_per_element(scalars, tensors))


def _addcmul_value_(self_: list, tensor1: list, tensor2: list, value: torch.Tensor) -> None:
    """Eager's ``_foreach_addcmul_(self, t1, t2, value)`` with ``value`` a 0-dim tensor.

    Each element's kernel computes ``self + (value * t1) * t2`` (``value`` in the tensors' dtype;
    float16/bfloat16: in float32, rounded once); as ``addcmul(self, t1 * value, t2)`` the same
    kernel does the same arithmetic (``_scale``).
    """
    scaled = _scale(tensor1, [value] * len(tensor1))
    if scaled is None:
        torch._foreach_addcmul_(self_, tensor1, tensor2, value)  # per element (``spmd.optim.hyper_rewrites``)
    else:
        _update(torch._foreach_addcmul, self_, scaled, tensor2)


def _addcdiv_scalars_(self_: list, tensor1: list, tensor2: list, scalars: list) -> None:
    """Eager's ``_foreach_addcdiv_(self, t1, t2, scalars)`` with ``scalars`` a list of 0-dim tensors:
    each element's kernel computes ``self + (scalar * t1) / t2`` (as above)."""
    scaled = _scale(tensor1, scalars)
    if scaled is None:
        for s, t1, t2, value in zip(self_, tensor1, tensor2, scalars):
            s.addcdiv_(t1, t2, value=value)
    else:
        _update(torch._foreach_addcdiv, self_, scaled, tensor2)


def _update(op, self_: list, tensor1: list, tensor2: list) -> None:
    """``self = op(self, t1, t2)`` in place. Where ``t1`` is float32 and ``self`` is not (``_scale``), the
    float32 result is rounded into ``self`` by a foreach copy: an in-place op of mixed dtypes would be
    traced with one cast per element, outside the foreach chain."""
    if tensor1[0].dtype == self_[0].dtype:
        getattr(torch, op.__name__ + "_")(self_, tensor1, tensor2)
    else:
        torch._foreach_copy_(self_, op(self_, tensor1, tensor2))


def multi_tensor_sgd(*args, torch_impl=None, **kwargs):
    """``torch.optim.sgd._multi_tensor_sgd`` as eager runs it: torch's own function with the compiling
    flag off, so the lr (a tensor while tracing) is applied as ``alpha=-lr`` of one add, not by a
    multiply then an add (its only use of the flag)."""
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = False
    try:
        return torch_impl(*args, **kwargs)
    finally:
        torch.compiler._is_compiling_flag = old


_PATCHES = (("torch.optim.adam", "_multi_tensor_adam", multi_tensor_adam),
            ("torch.optim.sgd", "_multi_tensor_sgd", multi_tensor_sgd))


@contextlib.contextmanager
def eager_foreach() -> Iterator[None]:
    """``torch.optim.adam`` and ``torch.optim.sgd`` run ``multi_tensor_adam`` and ``multi_tensor_sgd`` for
    their foreach groups inside this context."""
    originals = []
    try:
        for name, attr, replacement in _PATCHES:
            module = importlib.import_module(name)  # the module (``torch.optim.adam`` may name the function)
            original = getattr(module, attr)
            originals.append((module, attr, original))
            setattr(module, attr, functools.partial(replacement, torch_impl=original))
        yield
    finally:
        for module, attr, original in reversed(originals):
            setattr(module, attr, original)
