"""The scaling model (``spmd timeline TRACE --predict``) on a synthetic 2-GPU trace with known sizes and times."""

from __future__ import annotations

import json

import pytest

from spmd.tools.scaling import predict


def _nccl(name: str, kind: str, in_n: int, out_n: int, dtype: str, ms: float, ts: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": ms * 1e3,
            "args": {"Collective name": kind, "In msg nelems": in_n, "Out msg nelems": out_n, "dtype": dtype,
                     "Group size": 2}}


def _trace(tmp_path) -> str:
    """One step: 30 ms of compute; three block units (a 100 MB bf16 gather, a 200 MB fp32 reduce-scatter,
    each at 50 GB/s bus bandwidth), a root unit gathered and reduced once (400 MB / 800 MB, same speed),
    and one slower instance of a block gather (it waited for the other rank)."""
    events = [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0.0, "dur": 30e3}]
    events.append(_nccl("ncclDevKernel_AllGather_RING_LL", "allgather_into_tensor_coalesced", 100_000_000,
                        200_000_000, "BFloat16", 4.0, 1.0))
    events.append(_nccl("ncclDevKernel_ReduceScatter_Sum_f32", "reduce_scatter_tensor_coalesced", 200_000_000,
                        100_000_000, "Float", 8.0, 2.0))
    for i in range(3):
        slow = 3.0 if i == 0 else 1.0
        events.append(_nccl("ncclDevKernel_AllGather_RING_LL", "allgather_into_tensor_coalesced", 25_000_000,
                            50_000_000, "BFloat16", slow, 10.0 + i))
        events.append(_nccl("ncclDevKernel_ReduceScatter_Sum_f32", "reduce_scatter_tensor_coalesced", 50_000_000,
                            25_000_000, "Float", 2.0, 20.0 + i))
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def test_prediction_follows_the_ring_cost_and_the_overlap_it_states(tmp_path):
    two, four, sixteen = predict(_trace(tmp_path), steps=1, sizes=[4, 16], gpus_per_node=8, inter_node_gbps=10.0)
    assert two["bus_gbps"] == pytest.approx(50.0) and two["compute_ms"] == pytest.approx(30.0)
    # 2 GPUs: the trace's fastest times; only the root's gather and reduce-scatter are exposed
    assert two["comm_ms"] == pytest.approx(4 + 8 + 3 * (1 + 2))
    assert two["exposed_ms"] == pytest.approx(4 + 8)
    # 4 GPUs in one node: every collective 1.5x ((n-1)/n from 1/2 to 3/4), blocks still hidden
    assert four["comm_ms"] == pytest.approx(1.5 * two["comm_ms"])
    assert four["exposed_ms"] == pytest.approx(1.5 * 12)
    # 16 GPUs across nodes at 10 GB/s: a block's reduce-scatter takes 15/16 * 200 MB / 10 GB/s = 18.75 ms,
    # more than its backward (2/3 of 30 ms over 3 units), and a gather (9.4 ms) more than its forward (10/3 ms):
    # the differences show for each unit
    rs, ag = 15 / 16 * 200e6 / 10e9 * 1e3, 15 / 16 * 100e6 / 10e9 * 1e3
    root = 15 / 16 * (800e6 + 400e6) / 10e9 * 1e3
    assert sixteen["unit_backward_comm_ms"] == pytest.approx(rs)
    assert sixteen["exposed_ms"] == pytest.approx(root + 3 * (rs - 20 / 3) + 3 * max(0.0, ag - 10 / 3), rel=1e-3)
    assert sixteen["step_ms"] == pytest.approx(30 + sixteen["exposed_ms"], rel=1e-3)


def test_a_trace_without_collectives_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}]}))
    with pytest.raises(ValueError, match="no NCCL kernels.*--record --modes spmd_fully_shard"):
        predict(str(path), steps=1, sizes=[8])
