"""``spmd.tools.peak_blocks``: the peak of an allocator snapshot's history and the blocks live there."""

from __future__ import annotations

import pickle

from spmd.tools import peak_blocks


def _frame(line: int) -> dict:
    return {"filename": "/tmp/torchinductor_x/ab/cabc.py", "line": line, "name": "call"}


def test_the_peak_is_replayed_from_allocations_and_completed_frees(tmp_path, capsys):
    """Two 100-byte blocks, one freed, then a 300-byte one: the peak is 400 bytes, with the live 100 and 300;
    a free not yet completed frees nothing."""
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": [_frame(10)]},
        {"action": "alloc", "addr": 2, "size": 100, "frames": [_frame(11)]},
        {"action": "free_requested", "addr": 2},
        {"action": "free_completed", "addr": 2},
        {"action": "alloc", "addr": 3, "size": 300, "frames": [_frame(12)]},
        {"action": "free_requested", "addr": 3},
    ]
    snapshot = {"device_traces": [trace],
                "segments": [{"blocks": [{"size": 300, "state": "active_allocated"}, {"size": 64, "state": "inactive"}]}]}
    peak = peak_blocks.replay(snapshot)
    assert peak.peak == 400 and [size for size, _ in peak.blocks] == [300, 100] and peak.before == 300
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    peak_blocks.main([str(path), "--top", "1"])
    out = capsys.readouterr().out
    assert "cabc.py:12 call" in out and "cabc.py:10" not in out and "2 blocks live at the peak" in out
