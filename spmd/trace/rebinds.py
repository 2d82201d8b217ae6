"""Global and closure variables the step rebinds: a counter replayed after every call, anything else named once.

A script's step often counts in a global (``global step; step += 1``) or, built inside a function, in a closure
variable (``nonlocal calls; calls += 1``). Tracing runs that Python once; a compiled step's later calls run
only the graph, so the count would stop at one. No ``__setattr__`` sees such a store, so ``recording_rebinds``
compares, around the trace, the variables the user's code stores to (``STORE_GLOBAL``, and ``STORE_DEREF`` of
a function's own closure variables, found in the bytecode of the step's function and of the user's functions it
names): a number changed by ``+=`` / ``-=`` becomes an ``Increment`` of its module's attribute or a
``CellIncrement``, replayed after every later call as a module counter is (``spmd.trace.side_effects``); any
other rebinding is said once, at the storing line, and a tensor stored so (a traced one) is taken back. A failed
trace puts every rebound variable back.
"""

from __future__ import annotations

import contextlib
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils._pytree as pytree

from .bytecode import instructions, line_of
from .host_reads import is_library, warn_at_line
from .side_effects import Increment
from .step_reach import nested_codes
from .user_objects import named_references

_MISSING = object()


class CellIncrement(Increment):
    """A replay of ``name += delta`` on a closure variable (the cell held: cells cannot be referenced weakly)."""

    def __call__(self, sign: int = 1) -> None:
        cell = self.ref()
        cell.cell_contents = cell.cell_contents + sign * self.delta


@dataclass
class _Place:
    """A variable the step's code stores to: a module global (``owner`` the module) or a closure cell."""

    owner: Any
    name: str
    line: tuple[str, int, dict]  # (file, line, globals) of a store
    augmented: bool  # every store to it is ``+=`` or ``-=``
    before: Any = _MISSING

    def value(self) -> Any:
        if isinstance(self.owner, types.ModuleType):
            return vars(self.owner).get(self.name, _MISSING)
        try:
            return self.owner.cell_contents
        except ValueError:  # an empty cell
            return _MISSING

    def put_back(self) -> None:
        if isinstance(self.owner, types.ModuleType):
            if self.before is _MISSING:
                vars(self.owner).pop(self.name, None)
            else:
                setattr(self.owner, self.name, self.before)
        elif self.before is not _MISSING:
            self.owner.cell_contents = self.before

    def described(self) -> str:
        if isinstance(self.owner, types.ModuleType):
            return f"the global {self.owner.__name__}.{self.name}"
        return f"the closure variable {self.name!r}"


def _stores(code: types.CodeType, opname: str) -> Iterator[tuple[str, int, bool]]:
    """(name, line, augmented) of each ``opname`` store in ``code``."""
    for instruction, augmented in instructions(code):
        if instruction.opname == opname:
            yield instruction.argval, line_of(code, instruction.offset), augmented


def _user_functions(fn: Callable) -> list[types.FunctionType]:
    """``fn`` and the user's functions its code names, in turn (``named_references``)."""
    top = getattr(fn, "__func__", fn)
    found = {id(top): top} if isinstance(top, types.FunctionType) else {}
    for _, _, value, _, _ in named_references(fn):
        if isinstance(value, types.FunctionType) and not is_library(value.__module__ or ""):
            found.setdefault(id(value), value)
    return list(found.values())


def _places(fn: Callable) -> list[_Place]:
    places: dict[tuple[int, str], _Place] = {}

    def add(owner: Any, name: str, file: str, line: int, namespace: dict, augmented: bool) -> None:
        place = places.setdefault((id(owner), name), _Place(owner, name, (file, line, namespace), augmented))
        place.augmented = place.augmented and augmented

    for f in _user_functions(fn):
        namespace = f.__globals__
        module = sys.modules.get(namespace.get("__name__", ""))
        if getattr(module, "__dict__", None) is namespace:
            for code in nested_codes(f.__code__):
                for name, line, augmented in _stores(code, "STORE_GLOBAL"):
                    add(module, name, code.co_filename, line, namespace, augmented)
        cells = dict(zip(f.__code__.co_freevars, f.__closure__ or ()))
        for name, line, augmented in _stores(f.__code__, "STORE_DEREF"):
            if name in cells:
                add(cells[name], name, f.__code__.co_filename, line, namespace, augmented)
    return list(places.values())


def _number(value: Any) -> bool:
    return type(value) in (int, float)


def _replay_of(place: _Place, now: Any) -> Optional[Increment]:
    if not (place.augmented and _number(place.before) and _number(now)):
        return None
    kind = Increment if isinstance(place.owner, types.ModuleType) else CellIncrement
    return kind(place.owner, place.name, now - place.before)


def _warn_rebound(place: _Place, tensor: bool) -> None:
    file, line, namespace = place.line
    kept = ("the tensor it gets has no value until the step runs, so it keeps the value it had before the step"
            if tensor else "it is set once, at trace, and later calls, which run the compiled graph, do not set it "
            "again")
    warn_at_line(file, line, namespace,
                 f"spmd.compile: the step rebinds {place.described()} at {file}:{line} while it is traced: {kept}. "
                 "Return the value from the step and set it outside (a counter, name += 1, is counted on every "
                 "call).")


@contextlib.contextmanager
def recording_rebinds(fn: Callable, replays: list) -> Iterator[None]:
    """Around the body (one trace of ``fn``), append to ``replays`` a replay of each global or closure counter
    the step increments, and name once each other variable it rebinds (module docstring); a body that raises
    puts them all back."""
    places = _places(fn)
    for place in places:
        place.before = place.value()
    try:
        yield
    except BaseException:
        for place in places:
            if place.value() is not place.before:
                place.put_back()
        raise
    for place in places:
        now = place.value()
        if now is place.before:
            continue
        replay = _replay_of(place, now)
        if replay is not None:
            replays.append(replay)
            continue
        tensor = any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(now))
        if tensor:  # a traced tensor: put back, as ``user_objects`` does on objects
            place.put_back()
        _warn_rebound(place, tensor)


__all__ = ["CellIncrement", "recording_rebinds"]
