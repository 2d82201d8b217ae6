"""Checks are exceptions, not ``assert``s: they hold where asserts are stripped (``python -O``).

The pass manager's module is compiled here as ``python -O`` compiles it (``optimize=1``: no asserts,
``__debug__`` false) and its ordering checks are exercised from that copy. A fresh ``python -O``
interpreter would do the same after compiling every module torch imports, whose cached bytecode it cannot use.
"""

from __future__ import annotations

import importlib.util
import types

import pytest


def _manager_compiled_as_under_O() -> types.ModuleType:
    spec = importlib.util.find_spec("spmd.passes.manager")
    code = compile(spec.loader.get_source(spec.name), spec.origin, "exec", optimize=1)
    module = importlib.util.module_from_spec(spec)
    exec(code, module.__dict__)
    return module


def test_pass_order_checks_raise_with_asserts_stripped():
    manager = _manager_compiled_as_under_O()
    probe = compile("assert False", "<probe>", "exec", optimize=1)
    exec(probe, {})  # no AssertionError: asserts are stripped in code compiled so

    @manager.graph_optimization_pass()
    def first(gm):
        pass

    @manager.graph_optimization_pass(prerequisites=[first])
    def needs_first(gm):
        pass

    @manager.graph_optimization_pass(apply_after=[first])
    def after_first(gm):
        pass

    missing = "^first are the prerequisites of needs_first but are not applied$"
    with pytest.raises(manager.PassOrderError, match=missing):
        needs_first(types.SimpleNamespace())
    gm = types.SimpleNamespace()
    after_first(gm)
    with pytest.raises(manager.PassOrderError, match="^after_first must be applied after first$"):
        first(gm)
    with pytest.raises(manager.PassOrderError, match="^Cannot apply after_first twice$"):
        after_first(gm)
