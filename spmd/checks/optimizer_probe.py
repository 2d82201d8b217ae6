"""Trace an optimizer only where the traced update provably equals eager's.

Whether spmd traces an optimizer exactly is not read from a list: before the first
trace of a step, each of its optimizers (class, param-group settings) not yet checked in
this process runs a probe. A copy of the optimizer, with the same class and groups, steps
a few small float64 tensors (on the optimizer's device, so the same kernels run) with
synthetic gradients twice: once traced by the same
capture as the user's step (state created by ``ensure_optimizer_state``,
hyperparameters as graph inputs, their values changed between steps as a scheduler
would) and once eagerly from empty state (a fused CUDA kernel's lr rounded to float32 in
both, as the traced step hands it over). Parameters and state must agree to float64
rounding; otherwise the step is refused with an ``SpmdCompileError`` naming the optimizer,
the difference and the optimizers known to pass, before anything of the user's runs or
changes.

A verdict (``Verdict``) is a value: it holds for every optimizer of the same ``_config`` (class, flags,
device, float64 or not, and each hyperparameter's sign and type: a float32 tensor lr is checked apart
from a float lr) whose values keep what the probe's traces assumed of them (``spmd.optim.hyperparams``:
the outcome of each comparison they took, each value they specialised on). The probe's traces learn
into facts of their own, never the step's. Verdicts are memoized per process by that description
(``_VERDICTS``, a pure cache: a probe for the same description finds the same verdict).

A restarted job need not probe again: where the step's compile cache is on, the verdict of one of
torch.optim's own optimizers is kept beside it (``CacheStore.checks``), named (``kept_name``) by the
versions of the code it follows from (torch's, which fixes the class's, and spmd's), the device's name
and ``_config``, and taken where what it assumed holds. An optimizer of another class is probed in every
process: its code may have changed since.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.optim.optimizer import _get_capturable_supported_devices

from ..compile_times import recording
from ..errors import SpmdCompileError, SpmdConfigError
from ..optim.hyperparams import LearnedFacts, flags, group_signature, hyper_items
from ..optim.state import ensure_optimizer_state
from ..trace.capture import capture_train_step
from ..trace.step_state import StepState

log = logging.getLogger(__name__)

# For the refusal message only: the probe decides, and tests/test_optimizers.py compares each of
# these with eager DDP in float64.
KNOWN_EXACT = ("SGD (fused: with dampening=0), Adam, AdamW, NAdam, RAdam, Adamax, Adagrad, Adadelta, RMSprop, Rprop "
               "(each single-tensor, foreach and fused where torch has it), ASGD (in float64: foreach=False)")
_STEPS = 3
# Relative to the largest magnitude compared. Float64 parameters: float64 rounding. Narrower ones:
# eager itself does some scalar math in float32 (a float32 step counter or tensor lr), so a
# probe in float64 may differ by float32 rounding of a scalar; that is what eager computes too.
_TOLERANCE = {True: 1e-12, False: 1e-6}


@dataclass(frozen=True)
class Verdict:
    """One probe's outcome: ``why`` the optimizer is refused (None: exact), what the probe's traces learned
    (``learned``) and what that made them assume of its param groups' values (``assumed``, ``_assumed``)."""

    why: Optional[str]
    learned: LearnedFacts
    assumed: tuple

    def holds_for(self, optim: torch.optim.Optimizer) -> bool:
        """Whether this verdict is ``optim``'s (one of the same ``_config``): its values keep what was assumed."""
        return _assumed(optim, self.learned) == self.assumed


def _assumed(optim: torch.optim.Optimizer, learned: LearnedFacts) -> tuple:
    """Per param group, what traces with ``learned`` facts assume of its values now (``group_signature``)."""
    return tuple(tuple(sorted(group_signature(optim, g, learned).items())) for g in optim.param_groups)


_VERDICTS: dict[tuple, list[Verdict]] = {}  # _config -> the verdicts probed in this process


def _float64(optim: torch.optim.Optimizer) -> bool:
    return all(p.dtype == torch.float64 for g in optim.param_groups for p in g["params"] if p.is_floating_point())


def _device(optim: torch.optim.Optimizer) -> torch.device:
    """Where the probe runs: the device of the optimizer's parameters (the kernels the step will
    use), or the CPU when they are spread over several devices or on the meta device."""
    devices = {p.device for g in optim.param_groups for p in g["params"]}
    device = devices.pop() if len(devices) == 1 else torch.device("cpu")
    return torch.device("cpu") if device.type == "meta" else device


def _kind(group: dict, key: str, index) -> tuple:
    """What the traced math depends on in one hyperparameter's type: a Python number, or a tensor of
    some dtype and device (eager computes with a tensor lr in its dtype, with a float in float64)."""
    value = group[key] if index is None else group[key][index]
    return (value.dtype, value.device.type) if torch.is_tensor(value) else (type(value).__name__,)


def _config(optim: torch.optim.Optimizer) -> tuple:
    """What a verdict holds for: everything the probe's outcome depends on. The class, float64 or
    not, the device, and per group its flags, and for each hyperparameter whether it is 0 or
    negative and its type (``_kind``)."""
    groups = tuple((flags(g), tuple((k, i, v == 0, v < 0, _kind(g, k, i)) for k, i, v in hyper_items(g)))
                   for g in optim.param_groups)
    return type(optim), _float64(optim), _device(optim), groups


def _copy(optim: torch.optim.Optimizer, params: list[list[nn.Parameter]]) -> torch.optim.Optimizer:
    """``optim``'s class and settings over ``params`` (one list per group), with fresh state and no hooks.

    Built by the class's constructor where it accepts the groups (with ``optim.defaults``, or
    with the groups alone, which carry every setting), so state a constructor creates (torch
    2.11's Adagrad makes its ``sum`` there) exists as it does for ``optim``; otherwise a bare
    copy of ``optim``'s attributes with empty state.
    """
    groups = [{**g, "params": ps} for g, ps in zip(optim.param_groups, params)]
    for kwargs in (optim.defaults, {}):
        try:
            return type(optim)([dict(g) for g in groups], **{k: v for k, v in kwargs.items() if k != "params"})
        except Exception:  # a constructor with other arguments (AdamW does not take decoupled_weight_decay)
            continue
    new = object.__new__(type(optim))
    # instance-level callables (a scheduler's wrapper of ``step``) are bound to ``optim``: leave them out
    new.__dict__.update({k: v for k, v in optim.__dict__.items() if not callable(v)})
    for name, value in optim.__dict__.items():
        if name.endswith("_hooks") and isinstance(value, dict):
            setattr(new, name, OrderedDict())
    new.state = defaultdict(dict)
    new.param_groups = groups
    return new


def _probe_params(n_groups: int, device: torch.device) -> list[list[nn.Parameter]]:
    gen = torch.Generator().manual_seed(0)
    return [[nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64).to(device)) for shape in ((2, 3), (3,))]
            for _ in range(n_groups)]


def _probe_step(module, optim, weights):
    """A loss whose gradient is ``w + p`` for each parameter: synthetic, and depending on the parameters."""
    loss = sum((p * w).sum() + 0.5 * (p * p).sum() for p, w in zip(module.parameters(), weights))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _schedule(optim: torch.optim.Optimizer, step: int, learned: LearnedFacts) -> None:
    """Change every nonzero hyperparameter the trace takes as an input by 10% before the last step, as a scheduler would.

    Specialised ones (``learned`` by the probe's trace, ``spmd.optim.hyperparams``) stay: changing them retraces.
    """
    if step != _STEPS - 1:
        return
    for group in optim.param_groups:
        fixed = learned.of(optim, group).specialised
        for key, index, value in hyper_items(group):
            if value == 0 or (key, index) in fixed:
                continue
            old = group[key] if index is None else group[key][index]
            new = torch.tensor(value * 0.9, dtype=old.dtype) if torch.is_tensor(old) else value * 0.9
            if index is None:
                group[key] = new
            else:
                items = list(group[key])
                items[index] = new
                group[key] = type(group[key])(items)


def _traced_run(optim, params, weights, learned: LearnedFacts) -> list[torch.Tensor]:
    module = nn.Module()
    module.params = nn.ParameterList([p for ps in params for p in ps])
    created = ensure_optimizer_state(optim)
    state = StepState([module], [optim], learned=learned)
    graph, *_ = capture_train_step(_probe_step, state, (module, optim, weights[0]), {})
    first = created.first_step if created is not None else {}
    for step, ws in enumerate(weights):
        _schedule(optim, step, learned)
        values = state.hyper_values()
        if step == 0:
            values = [first.get((s.group, s.key), v) for s, v in zip(state.hyper_slots, values)]
        hypers = [torch.tensor(v, dtype=s.dtype, device=s.device) for s, v in zip(state.hyper_slots, values)]
        with torch.no_grad():
            torch.fx.Interpreter(graph).run(*state.flat_tensors(), *hypers, *ws)
    return [t.detach() for t in (*state.params, *state.state_tensors)]


def _eager_run(optim, params, weights, learned: LearnedFacts) -> list[torch.Tensor]:
    module = nn.Module()
    module.params = nn.ParameterList([p for ps in params for p in ps])
    for group in optim.param_groups:
        if group.get("capturable") and params[0][0].device.type not in _get_capturable_supported_devices():
            group["capturable"] = False  # the reference where torch refuses capturable; the same update
    for step, ws in enumerate(weights):
        _schedule(optim, step, learned)
        for group in optim.param_groups:
            if group.get("fused") and params[0][0].device.type == "cuda" and not torch.is_tensor(group["lr"]):
                # the traced step hands a CUDA fused kernel its lr as a float32 tensor, the only tensor lr it takes
                group["lr"] = float(torch.tensor(group["lr"], dtype=torch.float32))
        _probe_step(module, optim, ws)
    state = StepState([module], [optim])
    return [t.detach() for t in (*state.params, *state.state_tensors)]


def _first_line(err: Exception) -> str:
    return str(err).splitlines()[0] if str(err) else ""


def _difference(optim: torch.optim.Optimizer, learned: LearnedFacts) -> str | None:
    """Why tracing ``optim`` is not exact (None if it is), from one probe whose traces learn into ``learned``."""
    n, device = len(optim.param_groups), _device(optim)
    gen = torch.Generator().manual_seed(1)
    weights = [[torch.randn(shape, generator=gen, dtype=torch.float64).to(device) for _ in range(n)
                for shape in ((2, 3), (3,))] for _ in range(_STEPS)]
    try:
        scratch = _probe_params(n, device)
        _eager_run(_copy(optim, scratch), scratch, weights[:1], learned)
    except Exception as err:  # an optimizer that cannot run this probe eagerly (LBFGS needs a closure, ...)
        return f"its step cannot run on plain dense gradients ({type(err).__name__}: {_first_line(err)})"
    try:
        traced_params = _probe_params(n, device)
        traced = _traced_run(_copy(optim, traced_params), traced_params, weights, learned)
    except SpmdConfigError:  # a setting of the user's (the backward's autocast), not the optimizer, is wrong
        raise
    except Exception as err:
        return f"its step cannot be traced ({type(err).__name__}: {_first_line(err)})"
    eager_params = _probe_params(n, device)
    eager = _eager_run(_copy(optim, eager_params), eager_params, weights, learned)  # after the trace: it knows what is specialised
    if len(traced) != len(eager) or any(a.shape != b.shape for a, b in zip(traced, eager)):
        return "its traced step keeps different state than eager"
    scale = max(max(float(b.abs().max()) for b in eager if b.numel()), 1.0)
    worst = max(float((a.double() - b.double()).abs().max()) for a, b in zip(traced, eager) if b.numel())
    if worst > _TOLERANCE[_float64(optim)] * scale:
        return f"its traced update differs from eager by {worst:.3g} after {_STEPS} float64 steps"
    return None


def kept_name(optim: torch.optim.Optimizer, config: tuple, code: str) -> Optional[str]:
    """The name ``optim``'s verdict is kept under between processes (equal across ranks and jobs), or None
    where it is not kept: a class outside torch.optim, whose code the torch version does not fix. ``code``:
    the versions of the code the verdict follows from (torch's and spmd's, as ``cache_key.versions``)."""
    cls = type(optim)
    if not cls.__module__.startswith("torch.optim."):
        return None
    device = config[2]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    text = repr((code, cls.__module__, cls.__qualname__, config[1], where, config[3]))
    return "optimizer-check-" + hashlib.sha256(text.encode()).hexdigest()[:40]


def _probe(optim: torch.optim.Optimizer, kept: Any, code: str) -> Verdict:
    """``optim``'s verdict: the one kept in ``kept`` (a ``CacheStore``) where it holds for ``optim``, else from a
    probe, then kept there."""
    config = _config(optim)
    name = kept_name(optim, config, code) if kept is not None else None
    found = kept.load(name) if name is not None else None
    if isinstance(found, dict) and isinstance(found.get("verdict"), Verdict) and found["verdict"].holds_for(optim):
        log.info("spmd: %s's check against eager kept in %s: %s", type(optim).__name__, kept.root,
                 found["verdict"].why or "exact")
        return found["verdict"]
    learned = LearnedFacts()
    # the probe's own trace phases belong to "optimizer_check", not to the step's "trace"
    with torch.random.fork_rng(devices=[]), recording({}):
        why = _difference(optim, learned)
    log.info("spmd: %s checked against eager: %s", type(optim).__name__, why or "exact")
    verdict = Verdict(why, learned, _assumed(optim, learned))
    if name is not None:
        described = {"optimizer check": type(optim).__name__, "torch": torch.__version__, "device": config[2].type,
                     "verdict": why or "exact"}
        try:
            kept.save(name, {"verdict": verdict, "compiled_for": described})
        except OSError as err:  # a directory that cannot be written only costs the next job a probe
            log.debug("spmd: could not keep %s's check in %s: %s", type(optim).__name__, kept.root, err)
    return verdict


def check_optimizers(optimizers: list[torch.optim.Optimizer], kept: Any = None, code: str = "") -> None:
    """Raise ``SpmdCompileError`` (nothing changed) if an optimizer's traced update would differ from eager's.

    ``kept``: the compile cache's store of verdicts (``spmd.step.cache_store.CacheStore.checks``), where they
    are kept between processes (see the module docstring), for ``code`` (``kept_name``); None: probe in each
    process.
    """
    for optim in optimizers:
        known = _VERDICTS.setdefault(_config(optim), [])
        verdict = next((v for v in known if v.holds_for(optim)), None)
        if verdict is None:
            verdict = _probe(optim, kept, code)
            known.append(verdict)
        why = verdict.why
        if why is not None:
            settings = {k: v for k, v in optim.defaults.items() if k != "params"}
            raise SpmdCompileError(
                f"spmd.compile: {type(optim).__name__}({settings}) cannot be compiled exactly: {why}. spmd checks "
                "every optimizer against eager before tracing it; these pass with their usual settings: "
                f"{KNOWN_EXACT} (torch.optim). Use one of them, or another implementation "
                f"(foreach=True / fused=True) of this one.{_tensor_hint(optim)}"
            )


def _tensor_hint(optim: torch.optim.Optimizer) -> str:
    """A sentence naming the hyperparameters given as tensors of a dtype other than float64, if any:
    eager computes with those in their own dtype, which the traced step does not follow everywhere."""
    named = sorted({f"{k} (a {str(v.dtype).replace('torch.', '')} tensor)" for g in optim.param_groups
                    for k, v in g.items() if torch.is_tensor(v) and v.dim() == 0 and v.dtype != torch.float64})
    if not named:
        return ""
    return (f" Its param groups hold {', '.join(named)}: give them as Python floats or float64 tensors "
            "(e.g. group['lr'] = float(lr)), which every optimizer above takes exactly.")
