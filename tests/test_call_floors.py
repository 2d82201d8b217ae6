"""A first call never calls up a floor.

The rooms stand on each other: ``graph_utils`` (and the leaf modules every room uses: errors, compile
times, the torch version table) at the bottom, ``passes`` on it, then the rooms of one concern (``trace``,
``parallel``, ``optim``, ``lower``, ``checks``), then ``step`` (the stages and the per-call machinery), and
``api`` on top. The import rules say who may import whom; this test watches a first call run (a profiler
over every call into our code) and checks that no function of a lower floor calls one of a higher floor: no
callbacks handed down, no lambda reaching back into the hub. The one call upward allowed is the
GraphModule interface of the ``IterGraphModule`` the passes edit (``.graph``, ``.recompile()``): the object
they are given to edit, reached through the interface any GraphModule has; and the stand-ins the trace puts
in place of ``time``'s and ``os.environ``'s functions, which spmd's own timers call too.
"""

from __future__ import annotations

import functools
import sys
from collections import Counter
from pathlib import Path

import torch

import spmd
from tests import parity

ROOT = Path(spmd.__file__).resolve().parent
FLOORS = {"graph_utils": 0, "passes": 1, "trace": 2, "parallel": 2, "optim": 2, "lower": 2, "checks": 2,
          "step": 3, "api": 4, "explain": 4, "__init__": 4}
THE_EDITED_OBJECT = {("iter_graph_module.py", "graph"), ("iter_graph_module.py", "recompile")}
# stand-ins the trace puts in place of ``time``'s, ``random``'s and ``os.environ``'s functions
# (``spmd.trace.host_reads``): whoever calls those while the step is traced calls these
STANDING_IN_FOR_THE_STDLIB = {("host_reads.py", "guarded"), ("host_reads.py", "getitem")}


@functools.lru_cache(maxsize=None)
def _room(filename: str):
    """(room, file name) of one of our source files, or None for anyone else's."""
    path = Path(filename).resolve()
    for top in (ROOT, ROOT.parent / "passes", ROOT.parent / "graph_utils"):
        if path.is_relative_to(top):
            parts = path.relative_to(top).parts
            room = top.name if top != ROOT else (parts[0] if len(parts) > 1 else parts[0][:-3])
            return room, path.name
    return None


def _calls_up_a_floor(run) -> Counter:
    """Calls made while ``run()`` runs from a function of ours into one of ours on a higher floor (a leaf module
    at the top of ``spmd/`` is floor 0), by (caller room, callee room, callee file, callee function)."""
    found = Counter()

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = _room(frame.f_code.co_filename)
        if callee is None:
            return
        caller = frame.f_back
        while caller is not None and _room(caller.f_code.co_filename) is None:
            caller = caller.f_back  # through torch's frames to the code of ours that called it
        if caller is None:
            return
        (below, _), (above, file) = _room(caller.f_code.co_filename), callee
        allowed = THE_EDITED_OBJECT | STANDING_IN_FOR_THE_STDLIB
        if FLOORS.get(above, 0) > FLOORS.get(below, 0) and (file, frame.f_code.co_name) not in allowed:
            found[(below, above, file, frame.f_code.co_name)] += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return found


def test_a_first_call_never_calls_up_a_floor():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    train_step = spmd.compile(cache_dir=False)(parity.train_step)
    x = torch.randn(4, 8)
    assert _calls_up_a_floor(lambda: train_step(model, optim, x)) == Counter()


def test_the_watch_sees_a_call_up_a_floor():
    """What the test above relies on: a function of the passes' room that calls into the hub is seen."""
    import spmd.passes

    room_of_passes = Path(spmd.passes.__file__).with_name("manager.py")
    namespace = {"compile_in_the_hub": spmd.api.compile}
    exec(compile("def a_pass():\n    return compile_in_the_hub()\n", str(room_of_passes), "exec"), namespace)
    found = _calls_up_a_floor(namespace["a_pass"])
    assert ("passes", "api", "api.py", "compile") in found, found
