"""Python side effects of the step: replayed on every call where they can be, else named once at trace.

Tracing runs the user's step once; a compiled step's later calls run only the graph. So Python
effects (a ``print``, a log record, a counter on a module) would happen once, at the first call,
where eager has them on every call. ``recording_side_effects`` watches the trace (from the user's
code only: torch and spmd pass through, ``host_reads.user_frame``) and decides per kind:

* ``print(...)`` and a logger's records (``logger.info``, ``logging.warning``, ...) without a tensor
  among their arguments, made by the user's code, are replayed after each later call, with the text
  made at trace, and said once (``RuntimeWarning``, at the call's line): a value that changes between
  calls is not seen in it. With a tensor they are not replayed (its text at trace is a placeholder):
  the warning says to print the returned value after the step. An installed package's log record
  (transformers' ``warning_once``) is logged as it is made, at trace, and not replayed: those are
  mostly said once anyway.
* ``owner.x += c`` / ``-= c`` on a number attribute (a counter) of one of the step's modules, or of
  one of the user's own objects it reaches (its ``self``, an argument, a global or closure variable:
  ``trainer.global_step += 1``; ``user_objects.reachable_objects``), is replayed as the same increment
  after each later call; the augmented assignment is read from the caller's bytecode, so a plain
  ``owner.x = value`` is never mistaken for one.
* any other attribute write on those is said once, naming ``Class.attribute``: a value is set once, at
  trace; a tensor computed in the step is not kept at all (``user_objects`` puts the old one back).
  A tensor stored in place of one is the trace's to handle: a module's is written back into the old
  one, an object's is refused by name (``step_reach.refuse_rebound``). A module's writes are seen
  through ``nn.Module.__setattr__``, an object's through its class's ``__setattr__``, wrapped for the
  trace around the one the class has (a frozen dataclass still refuses). Objects of torch, spmd, the
  standard library and installed packages are not watched: their writes are their own.
* a list, dict or set the step changes in place (``losses.append(loss)`` on a global or closure
  variable of the step, ``self.history.append(...)`` on one of its modules) is said once
  (``watching_containers``), at the line that changes it where the bytecode names it: the change
  happens once, at trace, and a tensor put there is taken out again (``user_objects``).

Replays are plain callables (``TracedStep.replays``), run by ``spmd.compile`` after each call but the
first (every process traces its step, a step whose lowering the compile cache keeps too); an lr scheduler's
step, which the trace does not run, and a value written into a param group, which the trace undoes, are
replayed after every call (``spmd.trace.scheduler_steps``, ``spmd.trace.python_writes``); a global or closure
counter (``global step; step += 1``) is replayed as a module's (``spmd.trace.rebinds``). A counter the step
also reads is watched, so a call traces again (``python_writes``).
"""

from __future__ import annotations

import builtins
import contextlib
import dis
import enum
import functools
import logging
import sys
import threading
import types
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from .bytecode import augmented_at, line_of
from .host_reads import Patches, installed_code, is_library, user_frame, warn_at, warn_at_line, where
from .step_reach import nested_codes
from .user_objects import named_references

_PLUMBING = frozenset({"logging", __name__})
_MISSING = object()


def _holds_tensor(values: Any) -> bool:
    return any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(values))


class Increment:
    """A replay of ``owner.name += delta`` (a module or a user's object, held weakly where it can be); ``undo``
    takes back the trace's own."""

    def __init__(self, owner: Any, name: str, delta: Any):
        self.ref, self.name, self.delta = _reference(owner), name, delta

    def __call__(self, sign: int = 1) -> None:
        owner = self.ref()
        if owner is not None:
            setattr(owner, self.name, getattr(owner, self.name) + sign * self.delta)

    def undo(self) -> None:
        self(-1)


def _reference(owner: Any) -> Callable[[], Any]:
    """A weak reference to ``owner``, or a strong one where its class allows none (``__slots__`` without
    ``__weakref__``): the compiled step then keeps it alive, as its replays need it."""
    try:
        return weakref.ref(owner)
    except TypeError:
        return lambda: owner


def counters(replays: list) -> list[tuple[Any, str]]:
    """(owner, attribute) of each counter among ``replays`` (``Increment``): its value changes after every
    call by design, so it is no change a compiled step must be traced again for."""
    return [(owner, r.name) for r in replays if isinstance(r, Increment) and (owner := r.ref()) is not None]


def undo_side_effects(replays: list) -> None:
    """Take back what the trace that recorded ``replays`` did to the step's modules and objects (its counters'
    steps), for a trace that failed or is done again."""
    for replay in reversed(replays):
        if isinstance(replay, Increment):
            replay.undo()


_MUTATORS = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault", "add",
             "discard", "sort", "reverse", "__setitem__", "__delitem__"}
_LARGEST = 10_000  # containers with more items are not watched (a data set, say)


def _contents(container: Any) -> Any:
    return list(container.items()) if isinstance(container, dict) else list(container)


def _changed(container: Any, before: list) -> bool:
    """Whether ``container`` holds other items than ``before`` (``_contents`` of it then), by identity."""
    now = _contents(container)
    if isinstance(container, set):
        return set(map(id, now)) != set(map(id, before))
    if len(now) != len(before):
        return True
    if isinstance(container, dict):
        return any(k is not j or v is not w for (k, v), (j, w) in zip(now, before))
    return any(a is not b for a, b in zip(now, before))


def _line_changing(codes: list, name: str) -> Optional[tuple[str, int]]:
    """(file, line) where one of ``codes`` loads ``name`` and calls a mutating method on it (``name.append``),
    else where it first loads ``name``, else None."""
    first = None
    for code in (c for top in codes for c in nested_codes(top)):
        listed = list(dis.get_instructions(code))
        for here, after in zip(listed, listed[1:] + [None]):
            if here.argval != name or not here.opname.startswith("LOAD_"):
                continue
            line = line_of(code, here.offset)
            if after is not None and after.opname.startswith("LOAD_") and after.argval in _MUTATORS:
                return code.co_filename, line
            first = first or (code.co_filename, line)
    return first


def _watched(fn: Callable, modules: list[nn.Module]) -> list[tuple]:
    """(what, name, container, its items now, the code that may change it, that code's globals) for each
    list, dict or set the step's code, or a function of the user's it names, names (globals, closure) and
    each one a step's module holds in a public attribute."""
    out, seen = [], set()

    def watch(what: str, name: str, value: Any, codes: list, namespace: dict) -> None:
        if type(value) in (list, dict, set) and id(value) not in seen and len(value) <= _LARGEST:
            seen.add(id(value))
            out.append((what, name, value, _contents(value), codes, namespace))

    for what, name, value, code, namespace in named_references(fn):
        watch(what, name, value, [code], namespace)
    for module in {id(m): m for root in modules for m in root.modules()}.values():
        cls = type(module)
        own = [base for base in cls.__mro__ if not is_library(base.__module__)]
        codes = [f.__code__ for base in own for f in vars(base).values() if isinstance(f, types.FunctionType)]
        namespace = vars(sys.modules[cls.__module__]) if cls.__module__ in sys.modules else {}
        for name, value in vars(module).items():
            if not name.startswith("_"):
                watch(f"{cls.__name__}.{name}", name, value, codes, namespace)
    return out


@contextlib.contextmanager
def watching_containers(fn: Callable, modules: list[nn.Module]) -> Iterator[None]:
    """Say once, after the body (a trace of ``fn`` on ``modules``) succeeded, which lists, dicts and sets it
    changed in place (see the module docstring). Enter it inside ``user_objects.untouched``, which then takes
    the tensors the trace put in them out again."""
    watched = _watched(fn, modules)
    yield
    for what, name, container, before, codes, namespace in watched:
        if not _changed(container, before):
            continue
        file, line = _line_changing(codes, name) or (codes[0].co_filename, codes[0].co_firstlineno) if codes \
            else ("<unknown>", 0)
        tensor = ", and the tensor put there is taken out again (it has no value until the step runs)" \
            if _holds_tensor(_contents(container)) else ""
        warn_at_line(file, line, namespace,
                     f"spmd.compile: the step changes {what} ({type(container).__name__}) in place at {file}:{line} "
                     f"while it is traced: the change happens once, at trace{tensor}; later calls, which run the "
                     "compiled graph, do not make it. Return the value from the step and change the container "
                     "outside it: loss = train_step(...); losses.append(loss).")


# plain values: one equal to another of the same type stands for it (``same_value``)
VALUE_TYPES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size,
               torch.layout, torch.memory_format, enum.Enum)


def same_value(old: Any, new: Any) -> bool:
    """Whether ``new`` in place of ``old`` changes nothing a later call could see: the same object, or an equal
    plain value (``VALUE_TYPES``) of the same type (a NaN for a NaN)."""
    if old is new:
        return True
    if type(old) is not type(new) or not isinstance(old, VALUE_TYPES):
        return False
    return old == new or (old != old and new != new)


def _print_again(args: tuple, kwargs: dict) -> None:
    builtins.print(*args, **kwargs)


def _watched_class(cls: type) -> bool:
    """Whether writes on instances of ``cls`` are watched: a class of the user's own (not torch's, spmd's, the
    standard library's or an installed package's) whose ``__setattr__`` can be wrapped and put back (its
    metaclass sets and deletes class attributes as ``type`` does; an ``Enum``'s does not)."""
    module = cls.__module__ or ""
    file = (getattr(sys.modules.get(module), "__file__", None) or "").replace("\\", "/").split("/")
    return (not is_library(module) and "site-packages" not in file and "dist-packages" not in file
            and type(cls).__setattr__ is type.__setattr__ and type(cls).__delattr__ is type.__delattr__)


def _user_objects(objects: Iterable) -> list:
    """The objects among ``objects`` (``user_objects.reachable_objects``) whose attribute writes are recorded as a
    module's are: those of the user's own classes (``_watched_class``) but modules, watched through
    ``nn.Module.__setattr__``, and optimizers, whose state the trace captures."""
    return [obj for obj in objects if hasattr(obj, "__dict__") and _watched_class(type(obj))
            and not isinstance(obj, (nn.Module, torch.optim.Optimizer))]


def _current(owner: Any, name: str) -> Any:
    """``owner.name`` before a write, or ``_MISSING`` where there is none (or its getter raised)."""
    try:
        return getattr(owner, name)
    except Exception:  # noqa: BLE001 - a property's getter may raise anything; the write decides
        return _MISSING


def _record_write(replays: list, frame, owner: Any, name: str, old: Any, value: Any) -> None:
    """Decide what the write ``owner.name = value`` the user's code made at ``frame`` (``old``: what it held
    before, or ``_MISSING``) becomes, the same for a module and a user's object: a counter's step (``+=`` or ``-=``
    of a number) is appended to ``replays`` as an ``Increment``; a tensor stored, or any other change, is said
    once, naming ``Class.name``, with the fix for a module (a buffer) or for an object (set it after the call).
    A tensor stored where one was is not said: the trace holds that one, and writes the new one back into it
    (a module's) or refuses the step naming it (``step_reach.refuse_rebound``)."""
    if type(old) in (int, float) and type(value) in (int, float) and augmented_at(frame.f_code, frame.f_lasti):
        replays.append(Increment(owner, name, value - old))
        return
    what, module = f"{type(owner).__name__}.{name}", isinstance(owner, nn.Module)
    if _holds_tensor(value):  # a tensor, or a list of them
        if _holds_tensor(old):
            return
        fix = (f"or register a buffer and update it in place (self.{name}.copy_(...)), which the graph does on "
               "every call." if module else f"and set {what} from what the call returns.")
        warn_at(frame, f"spmd.compile: the step stores a tensor it computes in {what} at {where(frame)}: the "
                "compiled step cannot keep it there (the attribute keeps the value it had before the step). "
                f"Return the tensor from the step instead, {fix}")
    elif old is _MISSING or not same_value(old, value):
        fix = ("or keep it in a buffer updated in place (self.register_buffer(name, tensor), then e.g. "
               "self.calls.add_(1)), which the graph updates on every call." if module else
               "from what it returns.")
        warn_at(frame, f"spmd.compile: the step sets {what} at {where(frame)} while it is traced: it is set "
                f"once, at trace, and later calls, which run the compiled graph, do not set it again. Set it "
                f"outside the step, {fix}")


def _past_setattr(frame):
    """The frame of the assignment that reached ``frame``: past ``__setattr__`` methods (a class's own, which
    calls its base's, as a module subclass's does with ``super().__setattr__``)."""
    while frame is not None and frame.f_code.co_name == "__setattr__" and frame.f_back is not None:
        frame = frame.f_back
    return frame


def _calling(write: Callable, original: Callable) -> Callable:
    """A class's ``__setattr__`` for the trace: ``write(original, ...)``, ``original`` the one it had."""
    def setattr_(self, name, value):
        return write(original, self, name, value)
    return setattr_


@contextlib.contextmanager
def recording_side_effects(modules: list[nn.Module], objects: list = ()) -> Iterator[list[Callable[[], None]]]:
    """Watch the body (one trace of a step on ``modules``, reaching ``objects``,
    ``user_objects.reachable_objects``) as the module docstring says; yields the list the replays are appended
    to. Everything patched is put back after the body, succeeded or raised."""
    replays: list[Callable[[], None]] = []
    thread = threading.get_ident()
    plain = _user_objects(objects)
    owned = {id(m) for root in modules for m in root.modules()} | {id(obj) for obj in plain}
    original_print, original_log, original_setattr = builtins.print, logging.Logger._log, nn.Module.__setattr__
    writing = False  # a recorded write runs: what its class's __setattr__ or a property's setter writes is its own

    def print_(*args, **kwargs):
        frame = user_frame(thread, _PLUMBING)
        if frame is not None and not _holds_tensor((args, kwargs)):
            if kwargs.get("file") is sys.stdout:
                kwargs = {k: v for k, v in kwargs.items() if k != "file"}  # the stdout of the call, not the trace's
            replays.append(functools.partial(_print_again, args, kwargs))
            warn_at(frame, f"spmd.compile: the step prints at {where(frame)}: the text is made once, at trace, and "
                    "printed again after each later call, so a value that changes between calls is not seen in "
                    "it. Print such values outside the step, from what it returns.")
        return original_print(*args, **kwargs)

    def log(self, level, msg, args, *rest, **kwargs):
        frame = user_frame(thread, _PLUMBING)
        if frame is not None and not installed_code(frame):  # an installed package's record is its own
            if _holds_tensor((msg, args)):
                warn_at(frame, f"spmd.compile: the step logs a tensor at {where(frame)}: while it is traced the "
                        "tensor has no value, and later calls, which run the compiled graph, log nothing. Return "
                        "the tensor and log it after the step: loss = train_step(...); log.info('%s', loss).")
            else:
                replays.append(functools.partial(self.log, level, msg, *args))
                warn_at(frame, f"spmd.compile: the step logs at {where(frame)}: the record is made once, at "
                        "trace, and logged again after each later call, so a value that changes between calls is "
                        "not seen in it. Log such values outside the step, from what it returns.")
        return original_log(self, level, msg, args, *rest, **kwargs)

    def write(original, owner, name, value):
        """``original(owner, name, value)``, recorded (``_record_write``) where the user's code wrote it on one of
        the step's modules or objects."""
        nonlocal writing
        frame = _past_setattr(user_frame(thread, _PLUMBING)) if id(owner) in owned and not writing else None
        if frame is None:
            return original(owner, name, value)
        old = _current(owner, name)
        writing = True
        try:
            original(owner, name, value)  # a frozen dataclass raises here, as eager does
        finally:
            writing = False
        _record_write(replays, frame, owner, name, old, value)
        return None

    def module_setattr(self, name, value):
        if id(self) not in owned or isinstance(value, (nn.Module, nn.Parameter)) or name in self._parameters \
                or name in self._buffers or name in self._modules:  # the module's structure: traced as such
            return original_setattr(self, name, value)
        return write(original_setattr, self, name, value)

    patches = Patches()
    try:
        patches.set(builtins, "print", print_)
        patches.set(logging.Logger, "_log", log)
        patches.set(nn.Module, "__setattr__", module_setattr)
        # each class's own __setattr__, taken before any is wrapped: a subclass's must not call its base's wrapper
        for cls, original in {type(obj): type(obj).__setattr__ for obj in plain}.items():
            patches.set(cls, "__setattr__", _calling(write, original))
        yield replays
    except BaseException:
        undo_side_effects(replays)  # a failed trace leaves no count behind
        raise
    finally:
        patches.restore()
