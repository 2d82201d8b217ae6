"""Values the step reads from the host while it is traced, which a compiled step would freeze.

The trace runs the user's step once; whatever Python value it computes then is a constant of the
graph. Eager draws a new ``random.random()`` or ``numpy.random.rand()`` on every call, reads the
clock anew, and reads a tensor's value with ``.item()`` after computing it. ``checking_host_reads``
patches those functions for the length of the trace (restoring them after it, succeeded or
raised) and, where the call comes from the user's code (the innermost frame outside torch, spmd
and the patched library itself):

* a draw from ``random`` or ``numpy.random`` (module functions and ``random.Random`` instances) or a
  clock read (``time.time``, ``perf_counter``, ``monotonic``, ...) raises ``SpmdCompileError`` naming
  the call, its file:line and the fix (torch's RNG, which the graph draws on every call, or the value
  passed as an argument);
* ``tensor.item()`` whose value only the running step knows is refused alike, by the trace, at the
  user's line (``value_read_error``; a hyperparameter read so is its value: ``spmd.trace.hyper_reads``);
  made into text there (``print(loss.item())``, ``f"{loss.item()}"``), it is refused at once, before a
  symbol's name is printed;
* an ``os.environ`` / ``os.getenv`` read in the user's code warns (``RuntimeWarning``), once per place, that
  the step keeps the value read at trace: environment variables are configuration, and library code reading
  one is never refused (nor warned about: an installed package's read is its configuration).

Names the step's module, or a model class's module, bound to one of these functions before the trace
(``from time import time``) are patched in those namespaces too. Calls made from torch or spmd (their
own timers, RNG seeding) pass through untouched. ``numpy.random.Generator`` and ``RandomState`` instances
are C objects no patch can see: the ones the step reaches (a global, its closure, a module's attribute, an
argument or an attribute of an object it reaches) are refused when their state moved during the trace, and
``numpy.random.default_rng()`` without a seed is refused where the step calls it. Not seen: ``datetime.now()``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import random
import sys
import threading
import time
import types
import warnings
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn

from ..errors import SpmdCompileError, named
from .code_reads import note_environ_read

_CLOCKS = ("time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "process_time",
           "process_time_ns", "thread_time", "thread_time_ns")
_RANDOM = ("random", "uniform", "randint", "randrange", "choice", "choices", "shuffle", "sample", "gauss",
           "normalvariate", "lognormvariate", "expovariate", "vonmisesvariate", "gammavariate", "betavariate",
           "paretovariate", "weibullvariate", "triangular", "getrandbits", "randbytes", "binomialvariate")
_NOT_DRAWS = {"seed", "get_state", "set_state", "get_bit_generator", "set_bit_generator"}
_ENVIRON_TYPE = type(os.environ)


# torch, spmd and what torch itself calls (sympy draws from ``random`` while torch reasons about shapes)
_LIBRARIES = frozenset({"torch", "spmd", "functorch", "sympy", "mpmath", "networkx", "triton", "filelock", "jinja2",
                        "fsspec", "typing_extensions"}) | frozenset(sys.stdlib_module_names)
# the patched functions' own modules: a call between them is one call of the caller's
_PLUMBING = frozenset({"random", "os", "collections", "numpy", __name__})  # _collections_abc is "collections.abc"
_ITEM_PLUMBING = _PLUMBING | {"torch._subclasses.fake_tensor"}  # where a user's .item() or .tolist() runs item()
_TEXT_PLUMBING = _PLUMBING | {"spmd.trace.side_effects"}  # print() while a trace records it


def _top(frame) -> str:
    return (frame.f_globals.get("__name__") or "").split(".")[0]


def user_frame(thread: int, plumbing: frozenset = _PLUMBING, depth: int = 2):
    """The frame of the user's code that called into a patched function (the caller ``depth`` frames up, past
    frames of the modules named in ``plumbing``), or None where a library (``_LIBRARIES``) did, or where the
    call was made on another thread than ``thread``, the trace's (a data loader's, say)."""
    if threading.get_ident() != thread:
        return None
    frame = sys._getframe(depth)
    while frame is not None and (_top(frame) in plumbing or frame.f_globals.get("__name__") in plumbing):
        frame = frame.f_back
    if frame is None or _top(frame) in _LIBRARIES:
        return None
    return frame


def warn_at(frame, message: str) -> None:
    """A ``RuntimeWarning`` attributed to ``frame``'s line, once per place."""
    warn_at_line(frame.f_code.co_filename, frame.f_lineno, frame.f_globals, message)


def warn_at_line(file: str, line: int, namespace: dict, message: str) -> None:
    """A ``RuntimeWarning`` attributed to ``file:line`` of the module whose globals are ``namespace``, once; it
    names the step being compiled by its own name (``spmd.errors.named``)."""
    warnings.warn_explicit(named(message), RuntimeWarning, file, line, module=namespace.get("__name__"),
                           registry=namespace.setdefault("__warningregistry__", {}))


def user_frame_of(tb: Optional[types.TracebackType]):
    """The innermost frame of the user's code (outside torch, spmd, the libraries they call) in ``tb``, or None."""
    found = None
    while tb is not None:
        if not is_library(tb.tb_frame.f_globals.get("__name__") or ""):
            found = tb.tb_frame
        tb = tb.tb_next
    return found


def torch_reader_of(tb: Optional[types.TracebackType], user) -> Optional[types.FrameType]:
    """The frame of torch's public Python code (``torch.nn``, ``torch.optim``, ``torch.utils``) that the user's
    frame ``user`` called and that read a value, innermost such frame below ``user`` in ``tb``; None where the
    user's own code read it (torch's dispatch and tracing machinery does not count)."""
    found, below = None, user is None
    while tb is not None:
        frame = tb.tb_frame
        if frame is user:
            below = True
        elif below and (frame.f_globals.get("__name__") or "").startswith(_TORCH_READERS):
            found = frame
        tb = tb.tb_next
    return found


_TORCH_READERS = ("torch.nn.modules", "torch.nn.functional", "torch.optim", "torch.utils.checkpoint")


def is_library(module_name: str) -> bool:
    return module_name.split(".")[0] in _LIBRARIES


@dataclasses.dataclass(frozen=True)
class Place:
    """A frame's code and line when it was noted, read by ``where`` as a frame is (a frame's line moves on as it
    runs)."""

    f_code: types.CodeType
    f_lineno: int


def where(frame) -> str:
    """``file:line (in function)`` of ``frame``."""
    return f"{frame.f_code.co_filename}:{frame.f_lineno} (in {frame.f_code.co_name})"


def _frozen_draw(name: str, frame) -> SpmdCompileError:
    return SpmdCompileError(
        f"spmd.compile: the step calls {name} at {where(frame)} while it is traced: the compiled step would "
        "keep the number drawn then and use it on every call, where eager draws a new one each call. Draw it "
        "with torch's RNG, which the graph draws anew on every call (e.g. torch.rand(()) or "
        "torch.randint(0, n, (), generator=g)), or draw it outside the step and pass it as an argument "
        "(a 0-dim tensor, which does not retrace when it changes).")


def _frozen_generator(name: str) -> SpmdCompileError:
    return SpmdCompileError(
        f"spmd.compile: the step draws from the numpy generator {name} while it is traced (its state moved): the "
        "compiled step would keep the numbers drawn then and use them on every call, where eager draws new ones "
        "each call. Draw them with torch's RNG, which the graph draws anew on every call (e.g. torch.rand(()) or "
        "torch.normal(0.0, 1.0, (n,), generator=g)), or draw them outside the step and pass them as a tensor.")


def _generator_state(generator: Any) -> bytes:
    """A numpy ``Generator``'s or ``RandomState``'s state, comparable with ``==``."""
    import pickle

    state = generator.bit_generator.state if hasattr(generator, "bit_generator") else generator.get_state()
    return pickle.dumps(state)


def _numpy_generators(fn: Callable, modules: list[nn.Module], namespaces: list[dict], reached: list
                      ) -> list[tuple[str, Any]]:
    """(where, generator) for each numpy ``Generator`` or ``RandomState`` the step's code can reach directly: a
    global of its module or of a model class's module, a closure variable, an attribute of one of its modules,
    one among ``reached`` (its arguments and the objects it reaches, ``spmd.trace.user_objects``) or held by one
    of them, say a trainer's config (C objects whose draws no patch can see; ``checking_host_reads`` compares
    their state instead)."""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is None:
        return []
    kinds = tuple(k for k in (getattr(numpy_random, "Generator", None), getattr(numpy_random, "RandomState", None))
                  if isinstance(k, type))
    found: dict[int, tuple[str, Any]] = {}
    for namespace in namespaces:
        for name, value in namespace.items():
            if isinstance(value, kinds):
                found.setdefault(id(value), (f"{name!r} (a global of {namespace.get('__name__')})", value))
    inner = getattr(fn, "__func__", fn)
    closure = inspect.getclosurevars(inner).nonlocals if inspect.isfunction(inner) else {}
    for name, value in closure.items():
        if isinstance(value, kinds):
            found.setdefault(id(value), (f"{name!r} (in the step's closure)", value))
    for root in modules:
        for path, module in root.named_modules():
            for name, value in vars(module).items():
                if isinstance(value, kinds):
                    found.setdefault(id(value), (f"{type(module).__name__}.{name} (of module {path or 'the model'!r})",
                                                 value))
    for obj in reached:
        if isinstance(obj, kinds):
            found.setdefault(id(obj), (f"a {type(obj).__name__} among the step's arguments", obj))
            continue
        held = vars(obj).items() if hasattr(obj, "__dict__") and not isinstance(obj, nn.Module) else ()
        for name, value in held:
            if isinstance(value, kinds):
                found.setdefault(id(value), (f"{type(obj).__name__}.{name} (an object the step reaches)", value))
    return list(found.values())


def _unseeded(name: str, original: Callable, thread: int) -> Callable:
    """``original`` (numpy's ``default_rng``), refusing a call from the user's code without a seed: a generator
    made so in the step draws other numbers on every eager call, which the trace would freeze."""
    @functools.wraps(original)
    def guarded(seed=None, *args, **kwargs):
        frame = user_frame(thread)
        if seed is None and frame is not None:
            raise _frozen_draw(f"{name}() without a seed", frame)
        return original(seed, *args, **kwargs)

    return guarded


def _frozen_clock(name: str, frame) -> SpmdCompileError:
    return SpmdCompileError(
        f"spmd.compile: the step calls {name} at {where(frame)} while it is traced: the compiled step would "
        "keep the time read then on every call. Read the clock outside the step (t0 = time.time(); "
        "loss = train_step(...); elapsed = time.time() - t0), or pass the value as an argument (a 0-dim "
        "tensor, which does not retrace when it changes).")


def value_read_error(frame=None, op=None, library=None) -> SpmdCompileError:
    """The step reads a tensor's value as a Python value (``frame``: where, ``op``: the aten op that read it,
    if known; ``library``: the frame of torch's own code that read it, which the user's line called, as
    ``AveragedModel.update_parameters`` or a ``BatchNorm`` with ``momentum=None`` do). A fresh error each
    time: a shared instance would collect every raise's traceback."""
    at = f" at {where(frame)}" if frame is not None else ""
    if op is not None:
        at = f" ({getattr(op, 'overloadpacket', op)}{at})"
    if library is not None:
        return SpmdCompileError(
            f"spmd.compile: train_step calls torch code that reads the value of a tensor: {where(library)}, "
            f"called{at or ' from the step'}. Only the running step knows that value, and a whole-step graph "
            "cannot capture a Python decision on it. Call that code outside train_step (after it returns), or "
            "use a form that keeps the value a tensor (a BatchNorm with a float momentum rather than None; an "
            "EMA written with tensor ops, torch._foreach_lerp_(ema_params, params, 1 - decay), instead of "
            "AveragedModel.update_parameters).")
    return SpmdCompileError(
        f"spmd.compile: train_step branches on or reads the value of a tensor{at} (e.g. `if loss > 0`, "
        "`loss.item()`, `float(t)`), a value only the running step knows, which a whole-step graph cannot capture. "
        "Compute the decision with tensor ops (torch.where), keep the value a tensor (loss * t, not "
        "loss * t.item()), return the tensor itself, or move it outside train_step.")


def _warn_environ(key: str, value: str, frame) -> None:
    """Warn once per place that the step read environment variable ``key`` at trace, where that place is the
    user's own code: an installed library reading its configuration (``TRANSFORMERS_...``) is a read the user
    cannot move, and a kept trace is guarded by the value anyway (``note_environ_read``)."""
    if installed_code(frame):
        return
    warn_at(frame, f"spmd.compile: the step reads the environment variable {key!r} ({value}) while it is traced: "
            "the compiled step keeps what it computed from that value, and later calls do not read it again. Read "
            "it outside the step and pass the value as an argument (a number retraces when it changes; a 0-dim "
            "tensor does not).")


def installed_code(frame) -> bool:
    """Whether ``frame`` runs code of an installed package (a file under site-packages or dist-packages)."""
    parts = frame.f_code.co_filename.replace("\\", "/").split("/")
    return "site-packages" in parts or "dist-packages" in parts


class Patches:
    """Attributes replaced for the trace, put back by ``restore`` (the ones a class had not are deleted)."""

    def __init__(self):
        self._saved: list[tuple[Any, str, bool, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        namespace = owner if isinstance(owner, dict) else vars(owner)
        self._saved.append((owner, name, name in namespace, namespace.get(name)))
        if isinstance(owner, dict):
            owner[name] = value
        else:
            setattr(owner, name, value)

    def restore(self) -> None:
        for owner, name, had, old in reversed(self._saved):
            if isinstance(owner, dict):
                owner[name] = old
            elif had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)
        self._saved.clear()


def _user_namespaces(fn: Callable, modules: list[nn.Module]) -> list[dict]:
    """The globals of the step's module and of each model class's module (not torch's or spmd's), where a
    name bound to a patched function before the trace (``from time import time``) is patched too."""
    found = {}
    code_globals = getattr(getattr(fn, "__func__", fn), "__globals__", None)
    if code_globals is not None:
        found[id(code_globals)] = code_globals
    for module in modules:
        for cls in {type(m) for m in module.modules()}:
            for base in cls.__mro__:
                source = sys.modules.get(base.__module__)
                if source is not None and not is_library(base.__module__):
                    found.setdefault(id(source.__dict__), source.__dict__)
    return list(found.values())


def _settle_dynamo_lookups() -> None:
    """Make Dynamo compute, before the patches below stand, the lookups it computes once per process and keeps:
    which callables are numpy's (by ``id``), which are ``torch.Tensor``'s methods, which torch objects have a rule.

    Dynamo runs inside a trace (a ``flex_attention``, a ``torch.compile``d submodule). Computed there, the lookups
    named our stand-ins instead of numpy's draws and ``Tensor.item``. The stand-ins are freed after the trace, and
    a function made later at a freed one's address was taken for a numpy function: Dynamo then refused to trace a
    block mask's ``and_masks`` closure on torch 2.15 ("attempted to trace numpy function"), in one run of the suite
    of several. Numpy's own draws were no longer recognised either. A torch without one of these lookups has
    nothing to settle there."""
    from torch._dynamo import trace_rules  # imported by every trace anyway: this only imports it first

    for name in ("_numpy_function_ids", "get_tensor_method", "get_torch_obj_rule_map"):
        lookup = getattr(trace_rules, name, None)
        if callable(lookup):
            with contextlib.suppress(Exception):  # a lookup this torch computes otherwise: nothing kept to mislead
                lookup()


@contextlib.contextmanager
def checking_host_reads(fn: Callable, modules: list[nn.Module], reached: list = ()) -> Iterator[list]:
    """Patch the host reads listed in the module docstring for the length of the body (a trace of ``fn`` on
    ``modules``; ``reached``: its arguments and the objects it reaches, whose numpy generators are watched),
    refusing or warning where the user's code makes one; everything is restored after it.
    Yields the places (``Place``) of the user's ``.item()`` and ``.tolist()`` calls whose value is a symbol
    (``value_read_error``'s place where the traced graph keeps one: a hyperparameter read so is specialised on
    instead)."""
    numpy_random = sys.modules.get("numpy.random")
    thread = threading.get_ident()
    value_reads: list = []  # places of the user's .item() calls whose value only the running step knows
    replaced: dict[int, Callable] = {}  # id(original) -> its guard, for the names bound in user namespaces

    def guard(name: str, original: Callable, error: Callable) -> Callable:
        @functools.wraps(original)
        def guarded(*args, **kwargs):
            frame = user_frame(thread)
            if frame is not None:
                raise error(name, frame)
            return original(*args, **kwargs)

        replaced[id(original)] = guarded
        return guarded

    def environ_read(self, key):
        frame = user_frame(thread)
        try:
            value = original_getitem(self, key)
        except KeyError:
            note_environ_read(key, None)
            if frame is not None:
                _warn_environ(key, "unset", frame)
            raise
        note_environ_read(key, value)
        if frame is not None:
            _warn_environ(key, f"= {value!r}", frame)
        return value

    def item(self):
        value = original_item(self)
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            frame = user_frame(thread, _ITEM_PLUMBING)  # a FakeTensor's tolist() reads its items with item()
            if frame is not None:
                value_reads.append(Place(frame.f_code, frame.f_lineno))  # the frame's line moves on
        return value

    def symbol_text(original: Callable) -> Callable:
        def as_text(self):
            frame = user_frame(thread, _TEXT_PLUMBING)  # print() is side_effects' while it records
            if frame is not None:  # the user's print(loss.item()) / f"{loss.item()}": the value is not known
                raise value_read_error(frame)
            return original(self)
        return as_text

    original_getitem, original_item = _ENVIRON_TYPE.__getitem__, torch.Tensor.item
    _settle_dynamo_lookups()
    patches = Patches()
    try:
        for name in _CLOCKS:
            if hasattr(time, name):
                patches.set(time, name, guard(f"time.{name}", getattr(time, name), _frozen_clock))
        for name in _RANDOM:
            if hasattr(random, name):
                patches.set(random, name, guard(f"random.{name}", getattr(random, name), _frozen_draw))
                patches.set(random.Random, name, guard(f"random.Random.{name}", getattr(random.Random, name),
                                                       _frozen_draw))
        draws = getattr(getattr(numpy_random, "mtrand", None), "_rand", None)  # the legacy global RandomState
        if draws is not None:
            for name in dir(numpy_random):
                value = getattr(numpy_random, name)
                if getattr(value, "__self__", None) is draws and name not in _NOT_DRAWS:
                    patches.set(numpy_random, name, guard(f"numpy.random.{name}", value, _frozen_draw))
        if callable(getattr(numpy_random, "default_rng", None)):
            patches.set(numpy_random, "default_rng", _unseeded("numpy.random.default_rng", numpy_random.default_rng,
                                                               thread))
        for namespace in _user_namespaces(fn, modules):
            for name, value in list(namespace.items()):
                if callable(value) and id(value) in replaced and namespace[name] is not replaced[id(value)]:
                    patches.set(namespace, name, replaced[id(value)])
        patches.set(_ENVIRON_TYPE, "__getitem__", environ_read)
        patches.set(torch.Tensor, "item", item)
        for symbol in (torch.SymInt, torch.SymFloat, torch.SymBool):  # the text of an .item() read (str, format)
            patches.set(symbol, "__repr__", symbol_text(symbol.__repr__))
        generators = [(where, g, _generator_state(g)) for where, g in
                      _numpy_generators(fn, modules, _user_namespaces(fn, modules), list(reached))]
        yield value_reads
        for where, generator, state in generators:
            if _generator_state(generator) != state:
                raise _frozen_generator(where)
    finally:
        patches.restore()
