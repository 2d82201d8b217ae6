"""Exposed-communication arithmetic on synthetic traces with known overlap."""

from __future__ import annotations

import pytest

from spmd.tools.trace_analysis import exposed_communication


def _k(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_fully_hidden_partly_hidden_and_exposed_comm():
    events = [
        _k("gemm", 0, 100), _k("ncclDevKernel_AllReduce", 20, 50),   # hidden
        _k("ncclDevKernel_AllReduce", 90, 40),                        # 10 hidden, 30 exposed
        _k("elementwise", 200, 10), _k("ncclDevKernel_AllReduce", 300, 25),  # exposed
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},  # not a kernel
    ]
    r = exposed_communication(events)
    assert r["comm_ms"] == pytest.approx((50 + 40 + 25) / 1000)
    assert r["exposed_comm_ms"] == pytest.approx((30 + 25) / 1000)
    assert r["compute_ms"] == pytest.approx(110 / 1000)
    assert r["overlapped_pct"] == pytest.approx(100 * 60 / 115)


def test_overlapping_comm_kernels_count_once_and_per_step():
    events = [_k("nccl:all_reduce", 0, 100), _k("nccl:all_reduce", 50, 100), _k("gemm", 100, 25)]
    r = exposed_communication(events, steps=2)
    assert r["comm_ms"] == pytest.approx(150 / 1000 / 2)
    assert r["exposed_comm_ms"] == pytest.approx(125 / 1000 / 2)
