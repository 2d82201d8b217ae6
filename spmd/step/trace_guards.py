"""What a kept trace stands on, and whether it still holds: the guards of ``spmd.step.trace_store``.

A trace is a function of the code it ran and the values that code read. ``guards_for`` turns what a trace
recorded (``spmd.trace.code_reads``) into guards, and ``failed_guard`` checks them in a later process before
the kept trace stands in for a new one:

* **code**: each source file of user code the trace ran, by the digest of its contents (a helper edited in
  another module, a model's ``forward``); code of an installed library (site-packages) by the library's
  version; torch's, spmd's own and Python's by their versions (in the index, ``trace_store``);
* **values**: the globals that code names, read again from their modules (a module among them also by the
  attributes the code names on it: ``config.SCALE``), and the roots the caller gives (the step function with
  its closure, its arguments, the modules, optimizers and scalers it reaches), each walked deeply
  (``fingerprint``): numbers and strings as they are, objects attribute by attribute, a module's parameters
  and an optimizer's state by their shapes and dtypes, never by their contents (those are the graph's inputs);
  a list of strings that an installed library's object holds in the order a set of them has in this process
  by its items alone, since that order follows the per-process string hash seed (``_in_set_order``);
* **the environment** variables the trace read.

A value the walk cannot check (an open file, a lock, a C object without a readable state) makes the trace
unkept (``Unguardable``, said in the log): it is traced again in every process, as it always was.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import enum
import functools
import hashlib
import importlib
import importlib.metadata
import io
import logging
import os
import sys
import sysconfig
import types
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn

from ..trace.code_reads import CodeReads
from ..trace.step_reach import global_names
from .describe import canonical_json, describe, describe_function, tensor_facts

_BUDGET = 200_000  # objects walked for one fingerprint before the value counts as too large to check
_NUMPY_BYTES = 16 << 20  # a numpy array larger than this is not hashed (and so not checked)


class Unguardable(ValueError):
    """A trace read something a guard cannot check in another process: the trace is not kept."""


@dataclass(frozen=True)
class TraceGuards:
    """A kept trace's guards (module docstring). ``files``: (path, SHA-256) of user source files;
    ``libraries``: (top-level package, version); ``names``: (module, global names read, attribute names the
    code reads on module globals); ``environ``: (name, value or None); ``values``: a digest of each global's
    fingerprint and of the roots'."""

    files: tuple
    libraries: tuple
    names: tuple
    environ: tuple
    values: dict


def guards_for(reads: CodeReads, roots: Any) -> TraceGuards:
    """The guards of a trace that recorded ``reads`` and whose roots' fingerprint is ``roots``
    (``fingerprint`` of what the caller reaches); ``Unguardable`` where something cannot be checked."""
    files: dict[str, str] = {}
    libraries: dict[str, Optional[str]] = {}
    names: dict[str, tuple[set, set]] = {}
    for code, namespace in reads.codes.items():
        kind = code_kind(code, namespace)
        if kind == "user" and _made_by_guarded_code(code, namespace, reads):
            kind = "skip"  # what it runs follows from its maker's code, guarded in turn
        if kind == "skip":
            continue
        module = namespace.get("__name__")
        if kind == "library":
            top = module.split(".")[0]
            libraries[top] = _library_version(top)
            continue
        path = _source_file(code, namespace)
        if path not in files:
            files[path] = _file_digest(path)
        if not isinstance(module, str) or getattr(sys.modules.get(module), "__dict__", None) is not namespace:
            raise Unguardable(f"{code.co_qualname if hasattr(code, 'co_qualname') else code.co_name} ({path}) ran "
                              "with globals of no imported module")
        read, attributes = names.setdefault(module, (set(), set()))
        read.update(n for n in global_names(code) if n in namespace)
        attributes.update(code.co_names)
    name_guards = tuple(sorted((m, tuple(sorted(r)), tuple(sorted(a))) for m, (r, a) in names.items()))
    environ = tuple(sorted(reads.environ.items()))
    return TraceGuards(tuple(sorted(files.items())), tuple(sorted(libraries.items())), name_guards, environ,
                       _values_digest(name_guards, roots))


def failed_guard(guards: TraceGuards, roots: Any) -> Optional[str]:
    """Why ``guards`` no longer hold in this process (the first guard that fails, in words), or None."""
    for path, digest in guards.files:
        try:
            if _file_digest(path) != digest:
                return f"{path} changed"
        except Unguardable:
            return f"{path} is gone"
    for top, version in guards.libraries:
        if _library_version(top) != version:
            return f"{top} is another version"
    for key, value in guards.environ:
        if os.environ.get(key) != value:
            return f"the environment variable {key} changed"
    try:
        values = _values_digest(guards.names, roots)
    except (Unguardable, ImportError, AttributeError) as err:
        return f"a value it read cannot be read again ({err})"
    changed = [name for name, digest in values.items() if guards.values.get(name) != digest]
    changed += [name for name in guards.values if name not in values]
    return f"{', '.join(sorted(changed))} changed" if changed else None


def _values_digest(name_guards: tuple, roots: Any) -> dict[str, str]:
    """A digest per global read (``module.name``) and one of the roots (``what the step reaches``)."""
    walk = _Walk()
    digests = {"what the step reaches (its function, arguments and state)": _digest(roots)}
    for module_name, read, attributes in name_guards:
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
        namespace = vars(module)
        for n in read:
            if n in namespace:
                digests[f"{module_name}.{n}"] = _digest(walk.value(namespace[n], f"{module_name}.{n}", attributes))
    return digests


def _digest(value: Any) -> str:
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


def fingerprint(value: Any, what: str) -> Any:
    """``value`` as a JSON value for a guard (module docstring): ``Unguardable`` naming ``what`` where a part
    of it cannot be checked."""
    return _Walk().value(value, what, ())


# --- where code comes from --------------------------------------------------------------------------------------


@functools.cache
def _skipped_roots() -> tuple[str, ...]:
    """Folders whose code the versions cover: torch's and spmd's own packages."""
    import spmd
    import spmd.graph_utils
    import spmd.passes

    roots = {os.path.dirname(torch.__file__)}
    # spmd.tools is not among them: its steps (the benchmark's) are user code, which the source digest misses
    roots.update(os.path.dirname(p.__file__) for p in (spmd, spmd.passes, spmd.graph_utils))
    return tuple(os.path.join(r, "") for r in roots)


@functools.cache
def _standard_library_roots() -> tuple[str, ...]:
    """Python's standard library (in a venv, ``lib/pythonX.Y`` holds ``site-packages`` too: libraries first)."""
    return tuple(os.path.join(sysconfig.get_paths()[k], "") for k in ("stdlib", "platstdlib"))


@functools.cache
def _library_roots() -> tuple[str, ...]:
    paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    paths.update(p for p in sys.path if os.path.basename(p.rstrip(os.sep)) in ("site-packages", "dist-packages"))
    return tuple(os.path.join(p, "") for p in paths)


def code_kind(code: types.CodeType, namespace: dict) -> str:
    """Where ``code`` comes from: "skip" (torch, spmd, the standard library: their versions cover it), "library"
    (an installed package: its version) or "user" (a source file of the user's, checked by its contents)."""
    return source_kind(code.co_filename, namespace)


def source_kind(filename: str, namespace: dict) -> str:
    """``code_kind`` of code from ``filename`` run under the globals ``namespace`` (a module's, for a module)."""
    module = namespace.get("__name__") or ""
    if filename.startswith("<frozen") or module.split(".")[0] in sys.stdlib_module_names:
        return "skip"
    if module.startswith("namedtuple_"):  # a namedtuple's __new__, which collections writes from its fields
        return "skip"
    source = filename if os.path.isabs(filename) else namespace.get("__file__") or filename
    if source.startswith(_skipped_roots()):
        return "skip"
    if source.startswith(_library_roots()):
        return "library"
    if source.startswith(_standard_library_roots()):  # after the libraries: a venv's site-packages lies under it
        return "skip"
    return "user"


def _made_by_guarded_code(code: types.CodeType, namespace: dict, reads: CodeReads) -> bool:
    """Whether ``code`` has no source of its own (made at run time, ``exec``'d in a namespace of no module) and
    was called by code whose source a guard checks (torch's, a library's, or a user file's): then it is a
    function of that code and the values it read."""
    if os.path.isfile(code.co_filename) or isinstance(namespace.get("__file__"), str):
        return False
    caller = reads.callers.get(code)
    if caller is None or caller[0] is code:
        return False
    caller_code, caller_namespace = caller
    kind = code_kind(caller_code, caller_namespace)
    return kind != "user" or os.path.isfile(caller_code.co_filename)


def _source_file(code: types.CodeType, namespace: dict) -> str:
    """The file whose contents decide ``code``: its own, or (code made at run time, such as a dataclass's
    ``__init__``) the file of the module it runs in."""
    if os.path.isfile(code.co_filename):
        return code.co_filename
    module_file = namespace.get("__file__")
    if isinstance(module_file, str) and os.path.isfile(module_file):
        return module_file
    raise Unguardable(f"{code.co_name} runs code from {code.co_filename}, which has no source file to check")


@functools.cache
def _distributions() -> dict:
    return importlib.metadata.packages_distributions()


def _library_version(top: str) -> Optional[str]:
    """"<distribution> <version>" of the installed distribution that provides the top-level module ``top``, else
    the module's ``__version__``. The distribution named as the module is asked first: mapping every installed
    distribution to its modules (``packages_distributions``) reads every distribution's file list, on a
    restarted job's first call."""
    named = _distribution_named(top)
    if named is not None:
        return f"{named.metadata['Name']} {named.version}"
    for dist in _distributions().get(top, ()):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return getattr(sys.modules.get(top), "__version__", None)


def _distribution_named(top: str) -> Optional[importlib.metadata.Distribution]:
    """The installed distribution named ``top`` where it says it provides the module ``top``, as
    ``packages_distributions`` reads it: its ``top_level.txt`` lists it, or its file list holds it (a package or
    a single file); else None."""
    try:
        dist = importlib.metadata.distribution(top)
    except importlib.metadata.PackageNotFoundError:
        return None
    if top in (dist.read_text("top_level.txt") or "").split():
        return dist
    record = dist.read_text("RECORD") or ""
    starts = (f"{top}/", f"{top}.py,")
    return dist if any(record.startswith(s) or f"\n{s}" in record for s in starts) else None


def _file_digest(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError as err:
        raise Unguardable(f"{path} cannot be read ({err.strerror})") from None


# --- values -----------------------------------------------------------------------------------------------------


def is_library_object(obj: Any) -> bool:
    top = (getattr(obj, "__module__", None) or "").split(".")[0]
    return top in ("torch", "spmd", "builtins", "numpy") or top in sys.stdlib_module_names


def _salted_hash(name: str, value: Any) -> bool:
    """Whether an attribute holds a ``hash()`` this process took (``_original_object_hash``, as transformers'
    GenerationConfig keeps): string hashes are salted per process, so it differs in every process, and what
    it is compared with is taken in the same process."""
    return isinstance(value, int) and name.lower().endswith("hash")


_SET_ORDER_MIN = 12  # strings a list needs before its order may count as a set's (``_in_set_order``)
_SET_ORDER_MAX = 4096  # strings beyond which a list is compared in order (a config's list made from a set is short)
_LINEAR_PROBES = 9  # slots after the one it probes that CPython's set table tries next (Objects/setobject.c)
_PERTURB_SHIFT = 5


def _in_set_order(v: Any) -> bool:
    """Whether ``v``, a list held by an installed library's object, holds at least ``_SET_ORDER_MIN`` distinct
    strings laid out as a set's table holds them in this process: most likely ``list(some_set)``, whose order
    follows the per-process string hash seed (diffusers keeps ``list(set(...) - set(...))`` in the config of
    every model and of the models inside it). Such a list is checked by its items alone, so another process's
    order of the same items passes.

    A set iterates its table slot by slot, and a string sits at one of the first slots its probe sequence
    tries (``_candidate_slots``). A list passes when, for a table size a set of that many strings can have,
    its strings take increasing slots that way, all but one in eight past the first eight (moved by strings
    the set held before). A list in a fixed order passes only by chance, less often the longer it is
    (BENCHMARKS.md, "Round 22"), and a list of a user's own object is always checked in its order."""
    n = len(v) if type(v) is list else 0
    if not _SET_ORDER_MIN <= n <= _SET_ORDER_MAX or not sys.flags.hash_randomization:
        return False
    if not all(type(x) is str for x in v) or len(set(v)) != n:
        return False
    size = 8
    while size <= 64 * n:
        if 3 * size >= 5 * n and _strings_in_slot_order(v, size - 1) >= n - (n - 8) // 8:  # a table is <= 3/5 full
            return True
        size *= 2
    return False


def _candidate_slots(x: str, mask: int) -> list[int]:
    """The slots of a ``mask + 1`` table that a set tries first for ``x``: its hash's slot and the linear probes
    after it, then those of the first perturbed slot (none linear near the table's end)."""
    h = hash(x)
    slot, perturb, slots = h & mask, h & ((1 << 64) - 1), []
    for _ in range(2):
        slots.extend(range(slot, slot + (_LINEAR_PROBES if slot + _LINEAR_PROBES <= mask else 0) + 1))
        perturb >>= _PERTURB_SHIFT
        slot = (slot * 5 + 1 + perturb) & mask
    return sorted(set(slots))


def _strings_in_slot_order(v: list, mask: int) -> int:
    """The most strings of ``v``, kept in their order, that can take increasing slots of a ``mask + 1`` table,
    each one of its ``_candidate_slots``. ``lowest[k]``: the lowest last slot of ``k`` such strings so far (a
    longest increasing subsequence; a string's slots are tried largest first, so it extends one chain only)."""
    lowest = [-1]
    for x in v:
        for slot in reversed(_candidate_slots(x, mask)):
            k = bisect.bisect_left(lowest, slot) - 1  # the longest chain that ends below ``slot``
            if k + 1 == len(lowest):
                lowest.append(slot)
            elif slot < lowest[k + 1]:
                lowest[k + 1] = slot
    return len(lowest) - 1


@functools.lru_cache(maxsize=4096)
def _is_installed_library_class(cls: type) -> bool:
    """Whether ``cls`` is defined in an installed library's module (site-packages; torch's and spmd's are not)."""
    module = sys.modules.get(getattr(cls, "__module__", "") or "")
    source = getattr(module, "__file__", None)
    return isinstance(source, str) and source_kind(source, vars(module)) == "library"


class _Walk:
    """One deep walk (``fingerprint``): shared objects and cycles by reference, at most ``_BUDGET`` objects."""

    def __init__(self):
        self.seen: dict[int, int] = {}
        self.alive: list = []  # keeps walked objects alive, so their ids stay theirs
        self.count = 0
        self.in_library = 0  # how many installed libraries' objects the walk is inside (``_in_set_order``)

    def value(self, v: Any, where: str, attributes: tuple = ()) -> Any:
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, (float, complex, bytes)):
            return repr(v) if not isinstance(v, bytes) else hashlib.sha256(v).hexdigest()
        if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size)):
            return str(v)
        if isinstance(v, torch.Tensor):
            return {"tensor": tensor_facts(v)}
        self.count += 1
        if self.count > _BUDGET:
            raise Unguardable(f"{where}: too much to check (over {_BUDGET} objects)")
        if id(v) in self.seen:
            return {"same as": self.seen[id(v)]}
        self.seen[id(v)] = len(self.seen)
        self.alive.append(v)
        return self._object(v, where, attributes)

    def _items(self, items, where: str) -> list:
        return [self.value(x, f"{where}[{k}]") for k, x in enumerate(items)]

    def _object(self, v: Any, where: str, attributes: tuple) -> Any:
        if isinstance(v, enum.Enum):
            return describe(v)
        if isinstance(v, io.IOBase):
            raise Unguardable(f"{where} is an open file, whose contents spmd cannot check")
        if isinstance(v, types.ModuleType):
            if is_library_object(v) or not attributes:
                return {"module": v.__name__}
            return {"module": v.__name__, "attributes": {a: self.value(getattr(v, a), f"{where}.{a}")
                                                         for a in attributes if hasattr(v, a)}}
        if self.in_library and _in_set_order(v):
            return {"list in a set's order": sorted(v)}
        if isinstance(v, (list, tuple)):
            return {type(v).__name__: self._items(v, where)}
        if isinstance(v, (set, frozenset)):
            return {"set": sorted((self.value(x, f"{where} item") for x in v), key=canonical_json)}
        if isinstance(v, dict):
            return {"dict": [[self.value(k, f"{where} key"), self.value(x, f"{where}[{k!r}]")] for k, x in v.items()]}
        if isinstance(v, type):
            return self._class(v, where)
        if isinstance(v, functools.partial):
            return {"partial": self.value(v.func, where), "args": self._items(v.args, where),
                    "keywords": self.value(v.keywords, where)}
        if isinstance(v, types.MethodType):
            return {"method": describe_function(v.__func__), "of": self.value(v.__self__, f"{where}.__self__")}
        if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, types.CodeType)):
            return self._function(v, where)
        if isinstance(v, nn.Module):
            return self._module(v, where)
        if isinstance(v, torch.optim.Optimizer):
            return self._optimizer(v, where)
        if type(v).__module__ == "numpy" and type(v).__name__ == "ndarray":
            if v.nbytes > _NUMPY_BYTES:
                raise Unguardable(f"{where} is a numpy array too large to check ({v.nbytes} bytes)")
            return {"ndarray": [list(v.shape), str(v.dtype), hashlib.sha256(v.tobytes()).hexdigest()]}
        if type(v).__module__.split(".")[0] == "numpy" and hasattr(v, "item") and not hasattr(v, "__dict__"):
            return {"numpy scalar": repr(v)}
        if isinstance(v, logging.Logger):
            return {"logger": v.name}
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {"class": self._class(type(v), where),
                    "fields": {f.name: self.value(getattr(v, f.name), f"{where}.{f.name}") for f in dataclasses.fields(v)}}
        state = self._state(v)
        if state is not None:
            with self._inside(type(v)):
                return {"class": self._class(type(v), where),
                        "attributes": {k: self.value(x, f"{where}.{k}") for k, x in sorted(state.items())
                                       if not _salted_hash(k, x)}}
        described = describe(v)  # meshes, groups, scalers, enums and other values spmd already describes
        if isinstance(described, dict) and described.get("repr", "") is None:
            raise Unguardable(f"{where} is a {type(v).__qualname__} whose value spmd cannot check")
        return described

    @contextlib.contextmanager
    def _inside(self, cls: type):
        """Walk an object of ``cls``'s state: inside an installed library's object where ``cls`` is one."""
        library = _is_installed_library_class(cls)
        self.in_library += library
        try:
            yield
        finally:
            self.in_library -= library

    @staticmethod
    def _state(v: Any) -> Optional[dict]:
        state = getattr(v, "__dict__", None) if not callable(getattr(v, "__func__", None)) else None
        slots = [s for cls in type(v).__mro__ for s in getattr(cls, "__slots__", ()) if isinstance(s, str)]
        if state is None and not slots:
            return None
        state = dict(state or {})
        state.update({s: getattr(v, s) for s in slots if s not in ("__dict__", "__weakref__") and hasattr(v, s)})
        return state

    def _class(self, cls: type, where: str) -> Any:
        described = describe(cls)
        if is_library_object(cls) or not isinstance(described, dict):
            return described
        constants = {}
        for base in cls.__mro__:
            if is_library_object(base):
                continue
            for name, attr in vars(base).items():
                if not name.startswith("__") and isinstance(attr, (bool, int, float, str, tuple, type(None))):
                    constants.setdefault(name, self.value(attr, f"{where}.{name}"))
        return {**described, "constants": constants}

    def _function(self, fn: Any, where: str) -> Any:
        if isinstance(fn, types.FunctionType) and not is_library_object(fn):
            closure = {}
            for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
                try:
                    closure[name] = self.value(cell.cell_contents, f"{where} closure {name}")
                except ValueError:
                    closure[name] = "<empty>"
            return {"function": describe_function(fn), "closure": closure,
                    "defaults": self.value(fn.__defaults__, f"{where} defaults"),
                    "keyword defaults": self.value(fn.__kwdefaults__, f"{where} defaults")}
        return describe_function(fn)

    def _module(self, m: nn.Module, where: str) -> Any:
        attrs = {k: v for k, v in vars(m).items() if k not in ("_parameters", "_buffers", "_modules")}
        modules = {n: self.value(c, f"{where}.{n}") for n, c in m._modules.items()}
        with self._inside(type(m)):
            attributes = {k: self.value(v, f"{where}.{k}") for k, v in sorted(attrs.items())}
        return {"class": self._class(type(m), where),
                "parameters": {n: self.value(p, f"{where}.{n}") for n, p in m._parameters.items()},
                "buffers": {n: self.value(b, f"{where}.{n}") for n, b in m._buffers.items()},
                "modules": modules, "attributes": attributes}

    def _optimizer(self, o: torch.optim.Optimizer, where: str) -> Any:
        # a numeric hyperparameter is a graph input: only that it is one (the kept trace's assumptions about its
        # value, a branch taken or a value specialised on, are checked apart: ``spmd.step.trace_store``)
        groups = [{k: "hyperparameter" if _python_numbers(v) else self.value(v, f"{where} group {i} {k}")
                   if k != "params" else len(v) for k, v in g.items()} for i, g in enumerate(o.param_groups)]
        state = [{k: self.value(v, f"{where} state") for k, v in sorted(o.state[p].items())}
                 for g in o.param_groups for p in g["params"] if p in o.state]
        hooks = {k: self.value(v, f"{where}.{k}") for k, v in sorted(vars(o).items()) if k.endswith("hooks")}
        defaults = {k: "hyperparameter" if _python_numbers(v) else v for k, v in o.defaults.items()}
        return {"class": self._class(type(o), where), "defaults": self.value(defaults, f"{where} defaults"),
                "groups": groups, "state": state, "hooks": hooks}


def _python_numbers(value: Any) -> bool:
    """A param group's numeric hyperparameter held as Python numbers (``lr``, ``betas``): a float64 graph input
    whatever its value. One held as a tensor is fingerprinted as a tensor (its dtype is the input's)."""
    items = value if isinstance(value, tuple) and value else (value,)
    return all(type(v) in (int, float) for v in items)


__all__ = ["TraceGuards", "Unguardable", "code_kind", "failed_guard", "fingerprint", "guards_for", "is_library_object",
           "source_kind"]
