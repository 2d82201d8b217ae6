"""Checks are exceptions, not ``assert``s: they hold under ``python -O``, which strips asserts."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent('''
    import types

    from spmd.passes import PassOrderError, graph_optimization_pass

    try:
        assert False
    except AssertionError:
        raise SystemExit("asserts are active: this is not running under python -O")

    @graph_optimization_pass()
    def first(gm):
        pass

    @graph_optimization_pass(prerequisites=[first])
    def needs_first(gm):
        pass

    @graph_optimization_pass(apply_after=[first])
    def after_first(gm):
        pass

    def refused(pass_fn, gm):
        try:
            pass_fn(gm)
        except PassOrderError as err:
            assert isinstance(err, AssertionError)  # stripped under -O; the except clause is what counts
            return str(err)
        raise SystemExit(f"{pass_fn.__name__} ran out of order under -O")

    print(refused(needs_first, types.SimpleNamespace()))
    gm = types.SimpleNamespace()
    after_first(gm)
    print(refused(first, gm))
    print(refused(after_first, gm))
''')


def test_pass_order_checks_raise_under_python_O():
    result = subprocess.run([sys.executable, "-O", "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr + result.stdout
    assert result.stdout.splitlines() == [
        "first are the prerequisites of needs_first but are not applied",
        "after_first must be applied after first",
        "Cannot apply after_first twice",
    ]
