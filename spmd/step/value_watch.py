"""The Python values a trace read besides its inputs and state, checked before every call (``ValueWatch``).

A compiled step runs the graph its trace made; the Python values the trace read were folded into that graph.
So a later call may run it only while those values are as they were: a global (``SHIFT = 10.0``, a config
object's field, ``config.SCALE`` of a config module), an attribute of a module or of an object it holds
(``model.temperature``, ``model.config.rope_theta``), a closure variable, a hook added to a module. The
arguments, the modules' tensors and the optimizers' settings are the step's signature
(``spmd.step.call_signature``); the torch settings around the call are ``spmd.step.dependencies.ambient``.

What a trace read is known by name only: the attribute and global names of the code it ran
(``read_names``: recorded with ``spmd.trace.code_reads`` where that is cheap, else the code the step can reach,
``reachable_functions``). The watch holds, for each place the step's globals, closure, modules and the objects
under them name by one of those names, the object it held after the trace; the contents of each list and
dict found there, and the hooks of each module. A call first compares identities (a few C-level passes); only
where an object differs is its value compared, and a number or string of equal value is no change. A value
that did change is named (``changed``), and the step is traced again for it, as ``torch.compile``'s guards
recompile.

Not watched: attributes the step itself counts and reads nowhere else (``self.calls += 1``, replayed after every
call; ``spmd.trace.python_writes``), tensors and modules (the signature's), optimizers (their hyperparameters are
inputs), objects of torch, spmd, numpy and the standard library (but for the read attributes of its bags of the
user's values, ``argparse.Namespace`` and ``types.SimpleNamespace``, and of lr schedulers: ``scheduler.last_epoch``),
the class attributes of classes, and the globals of installed libraries (their code and configuration are their
own).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import logging
import operator
import sys
import types
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.nn as nn
from torch.optim.lr_scheduler import LRScheduler

from ..optim.amp_scaler import GradScaler
from ..trace.block_masks import is_block_mask
from ..trace.code_reads import CodeReads
from ..trace.side_effects import VALUE_TYPES, same_value
from ..trace.step_reach import global_names, nested_codes
from .trace_guards import code_kind, is_library_object, source_kind

log = logging.getLogger(__name__)

_MISSING = object()  # an attribute that did not exist when the trace read the place
_BUDGET = 50_000  # places watched for one step; beyond, deeper values are left unwatched (said in the log)
# a module's entries the signature or the state check already follow
_MODULE_STATE = frozenset({"_parameters", "_buffers", "_modules", "training"})
_STEP_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")  # a module's
_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")  # a parameter's (``p.register_hook(...)``)
_MODULE_MACHINERY = nn.Module.__call__.__code__.co_filename  # torch/nn/modules/module.py: hooks, not values
# objects of the standard library and torch whose attributes are the user's values, changed between calls: the
# bags of a script's settings (``args = parser.parse_args()``) and an lr scheduler's counters (``last_epoch``)
_VALUE_BAGS = (argparse.Namespace, types.SimpleNamespace, LRScheduler)


def _global_hooks() -> list[tuple[str, str]]:
    """torch's process-wide module hooks (``register_module_forward_hook``, ...): their names in
    ``torch.nn.modules.module`` and in words."""
    return [(f"_global{key}", f"torch's global{key.replace('_', ' ')}") for key in _STEP_HOOKS]


def _owner_ref(owner: Any, on_free: Callable) -> Optional[Callable[[], Any]]:
    """How the watch holds an owner of watched places: weakly, or, for a ``types.SimpleNamespace`` (which
    cannot be referenced weakly), strongly, as the step's settings are kept anyway; None for anything else
    that cannot be held weakly (left unwatched)."""
    try:
        return weakref.ref(owner, on_free)
    except TypeError:
        return (lambda: owner) if isinstance(owner, types.SimpleNamespace) else None


def _hook_ids(owner: Any, key: str) -> list:
    """The ids of the hooks in ``owner``'s hook dict ``key`` (none where it has no such dict, or None)."""
    hooks = vars(owner).get(key) if isinstance(owner, (nn.Module, types.ModuleType)) else getattr(owner, key, None)
    return list(hooks or ())


def _hook_serial() -> int:
    """torch's serial number of hook registrations (``RemovableHandle.next_id``): it grows with every hook
    registered anywhere, so an unchanged number means no empty hook dict got one."""
    return torch.utils.hooks.RemovableHandle.next_id


def read_names(codes: Iterable[types.CodeType]) -> frozenset:
    """The names ``codes`` (and the code defined in them) can read as an attribute, a global or a key: their
    ``co_names``, plus the identifier-like strings among their constants (``getattr(cfg, "scale")``). The
    names ``nn.Module``'s own machinery reads are left out: its hooks are watched as hooks."""
    names: set[str] = set()
    for code in codes:
        if code.co_filename == _MODULE_MACHINERY:
            continue
        for c in nested_codes(code):
            names.update(c.co_names)
            names.update(k for k in c.co_consts if isinstance(k, str) and k.isidentifier())
    return frozenset(names)


def reachable_functions(fn: Callable, modules: list[nn.Module]) -> list[types.FunctionType]:
    """The functions a trace of ``fn`` on ``modules`` can run, as far as it is seen without running it: ``fn``
    and the modules' ``forward``, then, in turn, each function a global or closure variable of theirs holds and
    each method of the modules' classes their code names (``self.helper(...)``)."""
    classes = {type(m) for root in modules for m in root.modules()}
    methods: dict[str, list] = {}
    for cls in classes:
        for base in cls.__mro__:
            if base is not nn.Module and base is not object:
                for name, value in vars(base).items():
                    methods.setdefault(name, []).append(value)
    seen: set[int] = set()
    found: list[types.FunctionType] = []
    pending: list[Any] = [fn, *(cls.forward for cls in classes)]
    while pending and len(seen) < 20_000:
        obj = pending.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        obj = getattr(obj, "__func__", obj)
        obj = obj.func if isinstance(obj, functools.partial) else obj
        if isinstance(obj, type):  # a class the code names: what constructing it runs
            pending.extend(v for cls in obj.__mro__ if cls is not object for k, v in vars(cls).items()
                           if k in ("__init__", "__new__", "__call__", "forward"))
            continue
        if isinstance(obj, (property, staticmethod, classmethod)):
            pending.extend(f for f in (getattr(obj, "fget", None), getattr(obj, "fset", None),
                                       getattr(obj, "__func__", None)) if f is not None)
            continue
        if not isinstance(obj, types.FunctionType):
            continue
        found.append(obj)
        pending.extend(m for name in read_names([obj.__code__]) for m in methods.get(name, ()))
        if code_kind(obj.__code__, obj.__globals__) == "skip":
            continue
        namespace = obj.__globals__
        pending.extend(namespace[n] for n in global_names(obj.__code__) if n in namespace)
        pending.extend(_cell_value(c) for c in obj.__closure__ or ())
    return found


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _MISSING


def _shown(value: Any) -> str:
    if value is _MISSING:
        return "(unset)"
    text = repr(value) if isinstance(value, VALUE_TYPES) else f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


def _signatures_own(value: Any) -> bool:
    """Values the step's signature and state check follow (tensors, modules, optimizers, GradScalers,
    flex_attention masks), never watched here (and never held: a module, a tensor or an optimizer kept alive
    by a watch would keep a model's memory alive); a bound method too (it holds its object)."""
    return isinstance(value, (torch.Tensor, nn.Module, torch.optim.Optimizer, GradScaler)) or is_block_mask(value) \
        or callable(getattr(value, "__func__", None))


def _holds_signatures_own(container: Any) -> bool:
    items = container.values() if isinstance(container, dict) else container
    return any(map(_signatures_own, items))


def code_ran(fn: Callable, modules: list[nn.Module], reads: Optional[CodeReads]) -> list[tuple]:
    """(code, its globals) of what a trace of ``fn`` on ``modules`` ran: what it recorded (``reads``), else the
    code ``fn`` can reach."""
    if reads is not None:
        return list(reads.codes.items())
    return [(f.__code__, f.__globals__) for f in reachable_functions(fn, modules)]


class ValueWatch:
    """The places one trace read (module docstring): ``changed`` says which one changed since, or None.

    Every place is compared by the identity of what it holds (``id``), in C-level passes. So that an identity
    cannot be reused, the watch keeps each value: a number or string itself, an object by a weak reference
    whose end marks the watch for a full comparison. Owners (modules, objects, the Python modules whose
    globals are read) are held weakly too: a watch keeps no model alive."""

    def __init__(self) -> None:
        # places: (owner, key) -> the identity of what the owner's ``__dict__`` held there after the trace
        self._owners: list[weakref.ref] = []  # each owner once
        self._owner_of: list[int] = []  # per place: its owner's index in ``_owners``
        self._owner_index: dict[int, int] = {}  # while building: id(owner) -> index
        self._keys: list[str] = []
        self._ids: list[int] = []
        self._wheres: list[str] = []
        self._kept: list[Any] = []  # per place: the value, or a weak reference to it, or None (held by id only)
        self._cells: list[tuple[Any, int, Any, str]] = []  # (closure cell, id, kept, name)
        self._containers: list[tuple[Any, list, list, str]] = []  # (list or dict, keys, item ids, name)
        # (module, hook dict's key, hook ids, name): the dicts that held hooks after the trace, compared on every
        # call (a hook removed), and the empty ones, compared when a hook was registered anywhere since
        self._hooks: list[tuple[weakref.ref, str, list, str]] = []
        self._empty_hooks: list[tuple[weakref.ref, str, list, str]] = []
        self._hook_serial = _hook_serial()
        self._dirty = False  # a watched object or owner was freed: compare in full
        self._seen: set[int] = set()
        self._alive: list[Any] = []  # while building: keeps walked objects alive, so their ids stay theirs
        self._names: frozenset = frozenset()
        self._skip: frozenset = frozenset()
        self.truncated = False

    @classmethod
    def after_trace(cls, fn: Callable, modules: list[nn.Module], args: tuple, kwargs: dict,
                    reads: Optional[CodeReads], counted: Iterable[tuple[Any, str]] = ()) -> "ValueWatch":
        """The watch of a trace of ``fn`` on ``modules`` with these arguments, taken right after it: ``reads``,
        what the trace ran where it was recorded (else the code ``fn`` can reach); ``counted``, the (owner,
        attribute) counters the step replays after every call and reads nowhere else. An object the walk cannot
        read leaves the watch empty, said once in the log as a warning: the step still compiles, as before the
        watch existed."""
        try:
            return cls._built(fn, modules, args, kwargs, reads, counted)
        except Exception as err:  # noqa: BLE001 - a step that compiles must not fail for its watch
            log.warning("spmd: the Python values the trace read cannot be watched (%s: %s); a change to one of "
                        "them will not make the step trace again", type(err).__name__, err)
            return cls()

    @classmethod
    def _built(cls, fn: Callable, modules: list[nn.Module], args: tuple, kwargs: dict,
               reads: Optional[CodeReads], counted: Iterable[tuple[Any, str]]) -> "ValueWatch":
        watch = cls()
        ran = code_ran(fn, modules, reads)
        watch._names = read_names(code for code, _ in ran)
        watch._skip = frozenset((id(m), name) for m, name in counted)
        for code, namespace in ran:
            module = sys.modules.get(namespace.get("__name__", ""))
            if code_kind(code, namespace) != "user" or getattr(module, "__dict__", None) is not namespace:
                continue
            for name in global_names(code):
                place = (id(module), name)
                if name in namespace and place not in watch._seen and place not in watch._skip:
                    watch._place(module, name, f"global {module.__name__}.{name}")
        for root in _callables(fn):
            watch._function(root, getattr(root, "__qualname__", "the step"))
        for k, leaf in enumerate(itertools.chain(args, kwargs.values())):
            watch._value(leaf, f"argument {k}")
        for root in modules:
            for path, m in root.named_modules(remove_duplicate=True):
                watch._module(m, f"{type(root).__name__}{'.' + path if path else ''}")
        for key, where in _global_hooks():
            watch._hook_dict(sys.modules["torch.nn.modules.module"], key, where)
        if watch.truncated:
            log.info("spmd: the step reads more than %d Python values; changes deeper than those are not watched",
                     _BUDGET)
        watch._seen.clear()
        watch._alive.clear()
        watch._owner_index.clear()
        return watch

    def __len__(self) -> int:
        return len(self._keys) + len(self._cells) + len(self._containers) + len(self._hooks) + len(self._empty_hooks)

    # --- building ------------------------------------------------------------------------------------------

    def _full(self) -> bool:
        if len(self) >= _BUDGET:
            self.truncated = True
        return self.truncated

    def _mark_dirty(self, _ref: Any = None) -> None:
        self._dirty = True

    def _keep(self, value: Any) -> Any:
        """What the watch keeps of a value it compares by identity (class docstring)."""
        if isinstance(value, VALUE_TYPES) or value is _MISSING:
            return value
        try:
            return weakref.ref(value, self._mark_dirty)
        except TypeError:  # a list, dict, tuple: held, unless it holds what the signature follows
            return None if isinstance(value, (list, dict, tuple)) and _holds_signatures_own(value) else value

    def _place(self, owner: Any, key: str, where: str) -> None:
        """Watch ``owner.__dict__[key]`` (``owner`` held weakly)."""
        value = vars(owner).get(key, _MISSING)
        if _signatures_own(value) or self._full():
            return
        self._seen.add((id(owner), key))
        if id(owner) not in self._owner_index:
            self._owner_index[id(owner)] = len(self._owners)
            self._owners.append(_owner_ref(owner, self._mark_dirty))
        self._owner_of.append(self._owner_index[id(owner)])
        self._keys.append(key)
        self._ids.append(id(value))
        self._kept.append(self._keep(value))
        self._wheres.append(where)
        self._value(value, where)

    def _attributes(self, obj: Any, where: str, exclude: frozenset = frozenset()) -> None:
        state = getattr(obj, "__dict__", None)
        if not isinstance(state, dict):
            return
        if _owner_ref(obj, self._mark_dirty) is None:
            return  # an object that cannot be held weakly: left unwatched
        for key in sorted(self._names.intersection(state).difference(exclude)):
            if (id(obj), key) not in self._skip:
                self._place(obj, key, f"{where}.{key}")

    def _module(self, m: nn.Module, where: str) -> None:
        if id(m) in self._seen:
            return
        self._seen.add(id(m))
        self._alive.append(m)
        self._attributes(m, where, _MODULE_STATE)
        for key in _STEP_HOOKS:
            hooks = vars(m).get(key)
            if isinstance(hooks, dict):
                self._hook_dict(m, key, f"{where}.{key}")
        for name, p in m.named_parameters(recurse=False):
            for key in _TENSOR_HOOKS:  # None until a hook is registered: watched as empty
                self._hook_dict(p, key, f"{where}.{name}.{key}")

    def _hook_dict(self, owner: Any, key: str, where: str) -> None:
        """Watch the hooks in ``owner.key`` (a module's or torch's hook dict, a tensor's, which is None while it
        has none) by their handles' ids (new ones get new ids)."""
        ids = _hook_ids(owner, key)
        (self._hooks if ids else self._empty_hooks).append((weakref.ref(owner, self._mark_dirty), key, ids, where))

    def _function(self, fn: Any, where: str) -> None:
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            value = _cell_value(cell)
            if _signatures_own(value) or (id(cell), name) in self._skip:  # a counter the step keeps
                continue
            self._cells.append((cell, id(value), self._keep(value), f"closure variable {name} of {where}"))
            self._value(value, f"{name} (closure of {where})")

    def _value(self, value: Any, where: str) -> None:
        """Watch what is under ``value`` (its read attributes, its items), once per object."""
        if isinstance(value, (VALUE_TYPES, type)) or _signatures_own(value) or value is _MISSING \
                or id(value) in self._seen or self._full():
            return
        self._seen.add(id(value))
        self._alive.append(value)
        if isinstance(value, (list, dict)):
            if not _holds_signatures_own(value):
                self._contents(value, where)
        elif isinstance(value, (tuple, frozenset)):
            for k, item in enumerate(value):
                self._value(item, f"{where}[{k}]")
        elif isinstance(value, functools.partial):
            for k, item in enumerate((*value.args, *value.keywords.values())):
                self._value(item, f"{where} argument {k}")
        elif isinstance(value, types.FunctionType):
            if code_kind(value.__code__, value.__globals__) == "user":
                self._function(value, where)
        elif isinstance(value, types.ModuleType):  # a config module: config.SCALE
            if isinstance(getattr(value, "__file__", None), str) and source_kind(value.__file__, vars(value)) == "user":
                self._attributes(value, where)
        elif not is_library_object(value) or isinstance(value, _VALUE_BAGS):
            self._attributes(value, where)

    def _contents(self, container: Any, where: str) -> None:
        keys = list(container) if isinstance(container, dict) else list(range(len(container)))
        values = list(container.values()) if isinstance(container, dict) else list(container)
        self._containers.append((container, keys, list(map(id, values)), where))
        for key, value in zip(keys, values):
            self._value(value, f"{where}[{key!r}]")

    # --- checking ------------------------------------------------------------------------------------------

    def changed(self) -> Optional[str]:
        """The first watched place whose value changed since the trace, in words, or None. Places holding a new
        but equal number or string take the new object, so the next call compares identities again."""
        if self._dirty:
            freed = next((w for k, w in zip(self._owner_of, self._wheres) if self._owners[k]() is None), None)
            if freed is not None:
                return f"the object holding {freed} was freed"
        if self._keys:
            try:
                dicts = list(map(vars, map(operator.call, self._owners)))
                now = list(map(dict.get, map(dicts.__getitem__, self._owner_of), self._keys,
                               itertools.repeat(_MISSING, len(self._keys))))
            except TypeError:  # an owner was freed
                return "an object the trace read was freed"
            if self._dirty or list(map(id, now)) != self._ids:
                why = self._compare(now)
                if why:
                    return why
        for k, (cell, old_id, kept, where) in enumerate(self._cells):
            new = _cell_value(cell)
            if id(new) != old_id or self._dirty:
                why = self._differs(kept, new, where)
                if why:
                    return why
                self._cells[k] = (cell, id(new), self._keep(new), where)
        for container, keys, ids, where in self._containers:
            if len(container) != len(keys):
                return f"{where} changed length {len(keys)} -> {len(container)}"
            if isinstance(container, dict):
                if list(container) != keys or list(map(id, container.values())) != ids:
                    return f"{where} changed"
            elif list(map(id, container)) != ids:
                return f"{where} changed"
        registered = _hook_serial() != self._hook_serial or self._dirty  # a hook registered somewhere since
        for ref, key, ids, where in (*self._hooks, *(self._empty_hooks if registered else ())):
            owner = ref()
            if owner is not None and _hook_ids(owner, key) != ids:
                return f"the hooks in {where} changed"
        self._hook_serial = _hook_serial()
        self._dirty = False
        return None

    def _differs(self, kept: Any, new: Any, where: str) -> Optional[str]:
        """Why ``new`` is not what the watch kept (in words), or None where it stands for it."""
        old = kept() if isinstance(kept, weakref.ref) else kept
        if new is old or same_value(old, new):
            return None
        shown = "(freed)" if isinstance(kept, weakref.ref) and old is None else _shown(old)
        return f"{where} changed {shown} -> {_shown(new)}"

    def _compare(self, now: list) -> Optional[str]:
        for k, (kept, new) in enumerate(zip(self._kept, now)):
            if id(new) == self._ids[k] and not (self._dirty and isinstance(kept, weakref.ref) and kept() is None):
                continue
            why = self._differs(kept, new, self._wheres[k])
            if why:
                return why
            self._ids[k], self._kept[k] = id(new), self._keep(new)
        return None


def _callables(fn: Callable) -> Iterator[types.FunctionType]:
    """The plain functions behind ``fn`` (a bound method's, a partial's, a wrapper's ``__wrapped__``)."""
    while fn is not None:
        inner = getattr(fn, "__func__", None) or (fn.func if isinstance(fn, functools.partial) else None)
        if isinstance(fn, types.FunctionType):
            yield fn
            inner = getattr(fn, "__wrapped__", None)
        fn = inner


__all__ = ["ValueWatch", "read_names", "reachable_functions"]
