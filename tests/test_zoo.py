"""``spmd zoo``: its real models at toy sizes train under spmd.compile exactly as eagerly, and its command's
runs, failures and skips become the rows it reports.

Each model whose library imports here (transformers, peft, timm, torchvision, diffusers: the
``bench`` extra; the others are skipped, naming the package) trains two steps eagerly and under
``@spmd.compile()`` from the same seed-0 weights on the same batches, in float64 (Mixtral in
float32: its experts' grouped matmul has no float64 kernel); losses and parameters must agree, and
the parameters must have moved.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import threading
import time

import pytest
import torch
from torch.distributed.tensor import DTensor

import spmd
from spmd.graph_utils.nodes import tensor_bytes
from spmd.graph_utils.recompute_ops import inductor_inlines
from spmd.lower import piece_places
from spmd.tools import cli, zoo, zoo_profile, zoo_report, zoo_run
from spmd.tools.zoo_models import ZOO, ZooModel
from tests.dist import single_process_group

STEPS = 2
FLOAT32 = {"mixtral"}  # torch._grouped_mm: float32, bfloat16 and float16 only


def spec(model: str) -> zoo_run.Spec:
    missing = ZOO[model].missing()
    if missing:
        pytest.skip(f"{model} {missing}")
    return zoo_run.Spec(ZOO[model], toy=True, device=torch.device("cpu"),
                    dtype=torch.float32 if model in FLOAT32 else torch.float64)


def trained(s: zoo_run.Spec, mode: str):
    """``STEPS`` steps of the toy model in ``mode``: (losses, parameters after them)."""
    step = zoo_run.ZOO_MODES[mode].build(s)
    batches = s.batches()
    losses = [step(*batches[i % len(batches)], last_train_step=i == STEPS - 1) for i in range(STEPS)]
    params = [p.full_tensor() if isinstance(p, DTensor) else p for p in step.model.parameters()]  # fully_shard's
    return torch.stack(losses), [p.detach().clone() for p in params]


def assert_trains_as_eager(model: str, mode: str) -> None:
    s = spec(model)
    atol = 1e-6 if s.dtype == torch.float32 else 1e-12
    eager_losses, eager_params = trained(s, "eager")
    losses, params = trained(s, mode)
    torch.testing.assert_close(losses, eager_losses, rtol=0, atol=atol)
    assert len(params) == len(eager_params)
    for p, q in zip(params, eager_params):
        torch.testing.assert_close(p, q, rtol=0, atol=atol)
    initial = list(s.model().parameters())
    assert any(not torch.equal(p, q) for p, q in zip(params, initial)), "no parameter changed: nothing was trained"


@pytest.mark.parametrize("model", ["llama_lora", "qwen2", "mixtral", "t5", "vit", "resnet50"])
def test_spmd_step_matches_eager(model):
    """spmd.compile'd steps of a handful of zoo models (LoRA with a frozen base, tied embeddings, MoE,
    encoder-decoder, ViT, a channels_last ResNet with SGD momentum) compute eager's losses and parameters."""
    assert_trains_as_eager(model, "spmd")


def test_the_step_with_eagers_backward_dtypes_matches_eager():
    """The zoo's spmd_exact mode builds and, where autocast is off (the CPU's float64), trains as eager."""
    assert_trains_as_eager("gpt2", "spmd_exact")


@pytest.mark.parametrize("model", ["llama", "mixtral"])
def test_fully_shard_in_a_group_of_one_matches_eager(model):
    """The zoo's spmd_fully_shard mode (a unit per decoder layer) in a process group of one trains Llama, and the
    MoE whose experts' loops run outside the graph's CUDA graphs on a GPU, as eager."""
    with single_process_group():
        assert_trains_as_eager(model, "spmd_fully_shard")


class _Prepared(Exception):
    """Stops a compile at its pieces, with the graph it was about to cut."""

    def __init__(self, graph):
        super().__init__("the step graph, before it is cut")
        self.graph = graph


def _gpu_step_graph(model: str, device: str, monkeypatch) -> list:
    """The computing nodes of ``model``'s full-size step graph as spmd would cut it on a GPU, traced on ``device``
    (on the CPU as on the GPU: bf16 autocast, a fused AdamW, the GPU's default transformation; the CPU's foreach
    AdamW adds some thousand nodes to the end of the graph, and the cuts fall elsewhere)."""
    from spmd.lower import inductor, lowering
    from spmd.step.transformation import default_transformation

    def stop(prepared, *args):
        raise _Prepared(prepared)

    monkeypatch.setattr(inductor, "_in_pieces", stop)
    monkeypatch.setattr(lowering.Lowering, "pieces_on", lambda self, device: 4)
    if ZOO[model].missing():
        pytest.skip(f"{model} {ZOO[model].missing()}")
    s = zoo_run.Spec(ZOO[model], toy=False, device=torch.device(device), dtype=torch.float32, autocast=True)
    module = s.model()
    optim = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=True, capturable=device == "cuda")
    step = spmd.compile(gm_transformation=default_transformation("cuda", enable_cudagraphs=False))(zoo_run.train_step)
    with pytest.raises(_Prepared) as stopped:
        step(module, optim, *s.batches()[0], s.autocast)
    return [n for n in stopped.value.graph.graph.nodes if n.op == "call_function"]


def _inlined_crossing(body: list, after: int) -> int:
    """Bytes of the values crossing a cut after ``body[after]`` that the whole graph never allocates: Inductor
    computes them inside their readers' kernels, all near (``piece_places.FUSED_REACH``)."""
    index = {n: i for i, n in enumerate(body)}
    crossing = 0
    for made, node in enumerate(body[:after + 1]):
        last = max((index.get(u, len(body)) for u in node.users), default=made)
        if inductor_inlines(node) and after < last <= made + piece_places.FUSED_REACH:
            crossing += tensor_bytes(node)
    return crossing


@pytest.mark.parametrize("model, device", [
    ("llama", "cpu"), ("qwen2", "cpu"),
    pytest.param("llama", "cuda", marks=(pytest.mark.gpu,
                                         pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")))])
def test_an_llms_full_size_step_is_cut_beside_its_loss_not_through_its_float32_softmax(model, device, monkeypatch):
    """Traced as on the GPU (on the GPU too, where Round 56 measured Llama's peak) and balanced by weight alone, the
    full-size Llama's and Qwen2's steps are cut inside their losses, where float32 values over the vocabulary
    (Llama's logits less their maximum, 8192 x 32000: 1000 MiB) cross the cut: allocated there, though the whole
    graph computes them inside their readers' kernels, Llama's took the GPU step's peak over reduce-overhead's
    (BENCHMARKS.md, "Round 56"). With ``piece_places.over_the_peak`` the cut moves beside the loss: such values
    crossing a cut (attention's, tens of MiB, away from the peak) are a small part of that."""
    body = _gpu_step_graph(model, device, monkeypatch)
    with monkeypatch.context() as by_weight_alone:
        by_weight_alone.setattr(piece_places, "over_the_peak", lambda body_, anchors: [False] * len(body_))
        balanced = piece_places.cut_positions(body, 8)
    assert max(_inlined_crossing(body, i) for i in balanced) >= 1000 << 20, "the graph no longer shows the case"
    cuts = piece_places.cut_positions(body, 8)
    assert len(cuts) == 7
    assert max(_inlined_crossing(body, i) for i in cuts) < 256 << 20, [(body[i].name, _inlined_crossing(body, i))
                                                                      for i in cuts]


def child_args(*argv: str):
    p, commands = cli.parsers()
    return p.parse_args(["zoo", "--size", "toy", "--precision", "fp64", "--warmup", "1", "--windows", "2",
                         "--steps", "1", *argv])


def test_a_run_records_what_the_table_shows(tmp_path):
    """A cold run's process (here in this one) writes its timings, FLOPs, losses and first call; summarize
    derives the table's figures from them."""
    spec("gpt2")
    out = tmp_path / "cold.json"
    zoo_run.measure(0, 1, torch.device("cpu"), child_args("--child", "gpt2:eager:cold", "--child-out", str(out)))
    record = json.loads(out.read_text())
    assert record["status"] == "ok", record.get("traceback")
    assert record["flops_per_step"] > 0 and record["median_ms"] > 0 and record["first_call_s"] > 0
    assert len(record["round_medians_ms"]) == 2 and len(record["window_started_unix_s"]) == 2
    assert len(record["losses"]) == 1 + 1 + 2 * 2 * 1 + 1  # first call, warm-up, 2 windows x 2 x 1 step, last
    rows = [dict(model="gpt2", mode="eager", cold=record, warm=None)]
    zoo_report.summarize(rows)
    assert rows[0]["per_s"] == pytest.approx(2 * 16 / (record["median_ms"] / 1000))
    assert rows[0]["first_losses"] == record["losses"][:3]


def test_grouped_query_attention_is_counted_as_its_kernels_compute_it():
    """Every query head attends to its group's key and value head: the FLOPs of the attention with the key and
    value heads repeated to the query's, forward and backward, in each fused kernel's formula (torch 2.11's own
    formulas assert on fewer key and value heads, so the zoo's Llama and Qwen2 rows lost their FLOPs count)."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten
    q, kv, repeated = (2, 8, 16, 32), (2, 2, 16, 32), (2, 8, 16, 32)
    formulas = zoo_run.flop_formulas()
    for kind in ("efficient", "flash", "cudnn"):
        forward = formulas[getattr(aten, f"_scaled_dot_product_{kind}_attention")]
        backward = formulas[getattr(aten, f"_scaled_dot_product_{kind}_attention_backward")]
        assert forward(q, kv, kv) == sdpa_flop_count(q, repeated, repeated) > 0
        assert backward(q, q, kv, kv) == sdpa_backward_flop_count(q, q, repeated, repeated) > 0
    query, key, value = (torch.empty(shape, device="meta") for shape in (q, kv, kv))
    with FlopCounterMode(display=False, custom_mapping=formulas) as counter:
        aten._scaled_dot_product_flash_attention(query, key, value)
    assert counter.get_total_flops() == sdpa_flop_count(q, repeated, repeated)


def test_a_frozen_base_under_adapters_is_counted_by_the_parameter_estimate():
    """Where torch's counter fails, a token model's FLOPs are estimated from its parameters. A LoRA model's frozen
    base still runs its forward and passes the adapters' gradients back, so the estimate stands to the counted
    FLOPs as it does for the same model trained whole (it counted 6 per trained parameter only: a third of it)."""
    ratios = {}
    for name in ("llama", "llama_lora"):
        s = spec(name)
        model = s.model()
        ratios[name] = zoo_run.parameter_flops(model, s.batch * s.seq) / zoo_run.count_flops(s)
    assert ratios["llama_lora"] == pytest.approx(ratios["llama"], rel=0.1), ratios


def _can_lock(path, kind) -> bool:
    """Whether another process could take the file lock at ``path`` as ``kind`` now."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, kind | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def test_first_calls_share_the_timing_lock_and_timed_steps_hold_it_alone(tmp_path, monkeypatch):
    """With ``--jobs N``, a process's first call holds the lock shared (other first calls run beside it, no
    process times steps meanwhile), and its warm-up, each window and the profile hold it alone."""
    real, seen = zoo_run._turn, []

    @contextlib.contextmanager
    def probed(path, alone=True):
        with real(path, alone):
            seen.append((alone, _can_lock(path, fcntl.LOCK_SH), _can_lock(path, fcntl.LOCK_EX)))
            yield

    monkeypatch.setattr(zoo_run, "_turn", probed)
    out, lock = tmp_path / "cold.json", tmp_path / "timing.lock"
    zoo_run.measure(0, 1, torch.device("cpu"), child_args("--child", "gpt2:eager:cold", "--child-out", str(out),
                                                          "--lock", str(lock)))
    assert json.loads(out.read_text())["status"] == "ok"
    alone = (True, False, False)  # (alone, another first call may, another may time)
    assert seen == [(False, True, False), alone, alone, alone, alone]  # first call, warm-up, 2 windows, captures


def test_processes_timing_at_once_alternate_their_windows(tmp_path):
    """Two runs timing at the same time take a turn per window, so their windows interleave and a drift of the
    GPU's speed falls on both alike. Holding the lock for all of a run's windows (AAABBB) fails this."""
    lock, order, start = str(tmp_path / "timing.lock"), [], threading.Barrier(2)

    def timed(name: str) -> None:
        def window():
            order.append(name)
            time.sleep(0.05)
        start.wait()
        zoo_run.in_turns(lock, 3, window, handoff_s=0.2)

    threads = [threading.Thread(target=timed, args=(name,)) for name in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(order) == list("AAABBB")
    last = {name: len(order) - 1 - order[::-1].index(name) for name in "AB"}
    assert order.index("B") < last["A"] and order.index("A") < last["B"], order  # each timed before the other ended


def test_a_warm_run_keeps_where_its_first_call_went(tmp_path):
    """A warm run (the first call of a restarted process) records its compile phases and torch's compile timers
    beside the first call's time: where a restarted job's first call goes."""
    spec("gpt2")
    out = tmp_path / "warm.json"
    zoo_run.measure(0, 1, torch.device("cpu"), child_args("--child", "gpt2:spmd:warm", "--child-out", str(out)))
    record = json.loads(out.read_text())
    assert record["status"] == "ok", record.get("traceback")
    assert record["first_call_s"] > 0 and "median_ms" not in record
    assert record["compile_times"]["trace"] > 0 and isinstance(record["torch_timings"], dict)


def test_a_warm_run_that_traced_afresh_is_noted_with_why(tmp_path, monkeypatch):
    """A run keeps what spmd's kept traces said during its first call; the report notes a warm run that traced the
    step afresh and a cold run whose trace was not kept, with the reason, and says nothing of a reused trace."""
    spec("gpt2")
    monkeypatch.setenv("SPMD_TRACE_REUSE", "1")
    monkeypatch.setenv("SPMD_CACHE_DIR", str(tmp_path / "cache"))
    records = []
    for i in range(2):  # the first finds no kept trace and keeps its own; the second reuses it
        out = tmp_path / f"warm{i}.json"
        zoo_run.measure(0, 1, torch.device("cpu"), child_args("--child", "gpt2:spmd:warm", "--child-out", str(out)))
        records.append(json.loads(out.read_text()))
    afresh, reused = records
    assert any("no trace of it is kept" in m for m in afresh["trace_reuse"]), afresh["trace_reuse"]
    assert any("reused the trace" in m for m in reused["trace_reuse"]), reused["trace_reuse"]
    cold = dict(status="ok", spread_ms=dict(min=1.0, max=1.0), per="tokens", peak_gib=1.0, first_call_s=9.0,
                captures_per_step=0)
    row = dict(model="gpt2", mode="spmd", cold=cold, warm=reused, ms=1.0, per_s=1.0, tflops=None, mfu=None,
               first_losses=[1.0, 1.0, 1.0])
    assert zoo_report.cells(row)[0][-1] == ""
    row["warm"] = afresh
    assert zoo_report.cells(row)[0][-1] == f"warm run traced afresh: {afresh['trace_reuse'][-1]}"
    row["warm"], cold["trace_reuse"] = reused, ["spmd: train_step's trace is not kept for the next process: why"]
    assert zoo_report.cells(row)[0][-1] == f"cold run's trace: {cold['trace_reuse'][0]}"


def test_a_step_graph_compiled_whole_where_pieces_were_asked_for_is_noted_with_why():
    """A run keeps what ``spmd.lower.inductor`` said of a graph compiled whole where the default asks for pieces
    compiled side by side (Round 55: six Hugging Face models' steps were, unnoticed), and the report notes it."""
    said = zoo_run.SpmdSaid("spmd.lower.inductor", "compiled whole")
    with said as messages:
        logging.getLogger("spmd.lower.inductor").info("spmd: lowered the %s graph", "step")
        logging.getLogger("spmd.lower.inductor").info("spmd: the %s graph is compiled whole: %s", "step",
                                                      "it has a get_attr node (_tensor_constant0)")
    assert messages == ["spmd: the step graph is compiled whole: it has a get_attr node (_tensor_constant0)"]
    cold = dict(status="ok", spread_ms=dict(min=1.0, max=1.0), per="tokens", peak_gib=1.0, first_call_s=9.0,
                captures_per_step=0, compiled_whole=messages)
    row = dict(model="llama", mode="spmd", cold=cold, warm=None, ms=1.0, per_s=1.0, tflops=None, mfu=None,
               first_losses=[1.0, 1.0, 1.0])
    assert zoo_report.cells(row)[0][-1] == messages[0].removeprefix("spmd: ")


def test_a_profiled_run_keeps_its_heaviest_kernels_and_the_report_lists_them(tmp_path):
    """``--profile 2``: after the timed windows, two more steps under torch.profiler; the record keeps the time and
    number of kernels per step (on the CPU: ATen ops by their own time) and the heaviest by name, which the markdown
    lists under the table; the capture count covers the timed steps only."""
    spec("gpt2")
    out = tmp_path / "cold.json"
    args = child_args("--child", "gpt2:eager:cold", "--child-out", str(out), "--profile", "2")
    zoo_run.measure(0, 1, torch.device("cpu"), args)
    record = json.loads(out.read_text())
    assert record["status"] == "ok", record.get("traceback")
    found = record["profile"]
    assert found["steps"] == 2 and found["ms_per_step"] > 0 and found["kernels_per_step"] >= len(found["top"]) > 0
    assert all(name.startswith("aten::") and ms > 0 for name, ms, _ in found["top"])
    assert [ms for _, ms, _ in found["top"]] == sorted((ms for _, ms, _ in found["top"]), reverse=True)
    assert any(name in ("aten::mm", "aten::addmm", "aten::bmm") for name, _, _ in found["top"]), found["top"]
    assert found["top"] == found["kernels"][:len(found["top"])] and len(found["kernels"]) >= len(found["top"])
    rows = [dict(model="gpt2", mode="eager", cold=record, warm=None)]
    zoo_report.summarize(rows)
    text = zoo_report.markdown(rows, args, False, "cpu")
    assert "**gpt2 eager**: ATen ops (CPU self time)" in text and f"`{found['top'][0][0]}`" in text


def test_a_model_profiled_in_two_modes_on_a_gpu_gets_its_kernel_time_by_kind_side_by_side():
    """The kernel names of Round 25's BERT profiles, by kind: 2.2 ms more of 16-bit matmuls in one mode shows in
    the kind's row, and each column sums to the kernels' time. A generated kernel named after attention's ops
    (Round 46's Llama) counts as generated, not as attention."""
    def row(mode, kernels):
        profile = dict(steps=3, what="CUDA kernels", ms_per_step=sum(ms for _, ms, _ in kernels),
                       kernels_per_step=sum(c for _, _, c in kernels), top=kernels[:2], kernels=kernels)
        return dict(model="bert", mode=mode, cold=dict(profile=profile), warm=None)

    shared = [["sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize64x64x8", 5.0, 12],
              ["triton_per_fused__safe_softmax_add_exp_native_dropout", 5.5, 12],
              ["nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 5.0, 74]]
    rows = [row("compile", shared + [["cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_256x128_32x6_nt_align8", 1.0, 1]]),
            row("spmd", shared + [["cutlass_80_tensorop_bf16_s16816gemm_bf16_128x256_64x3_nt_align2", 3.2, 1],
                                  ["Memset (Device)", 0.1, 4],
                                  ["triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy_cat_cos", 0.3, 48],
                                  ["cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", 1.2, 8]])]
    text = zoo_profile.markdown(rows)
    table = text.split("**bert, kernel time by kind** (ms per step)")[1]
    assert "| kind | compile | spmd |" in table
    assert "| matmul, float32 | 5.00 | 5.00 |" in table and "| matmul, 16-bit | 6.00 | 8.20 |" in table
    assert "| generated (Triton) | 5.50 | 5.80 |" in table and "| copies and fills | 0.00 | 0.10 |" in table
    assert "| attention | 0.00 | 1.20 |" in table and "| all | 16.50 | 20.30 |" in table
    assert zoo_profile.markdown(rows[:1]).count("kernel time by kind") == 0  # one mode: nothing to set beside it


def test_a_failing_mode_is_a_failed_row_with_its_first_line(tmp_path, monkeypatch):
    """A mode whose build raises writes an error record naming the exception's first line; the table says FAILED."""
    spec("gpt2")

    def broken(s):
        raise RuntimeError("the step cannot be built\nsecond line")
    monkeypatch.setitem(zoo_run.ZOO_MODES, "eager", zoo_run.ZooMode(broken, "broken", compiles=False))
    out = tmp_path / "cold.json"
    zoo_run.measure(0, 1, torch.device("cpu"), child_args("--child", "gpt2:eager:cold", "--child-out", str(out)))
    record = json.loads(out.read_text())
    assert record["status"] == "error" and record["reason"] == "RuntimeError: the step cannot be built"
    text, state = zoo_report.cells(dict(model="gpt2", mode="eager", cold=record, warm=None))
    assert state == "failed" and text[-1] == "FAILED: RuntimeError: the step cannot be built"


def test_a_model_whose_library_is_missing_is_skipped_naming_it(tmp_path, monkeypatch):
    """Without its library a model's rows are skipped, with the package and the install command; no process runs."""
    monkeypatch.setitem(ZOO, "fake", ZooModel(lambda *a: None, ("no_such_zoo_library",), "fake", 1, 1, 1, 1, "Block"))
    monkeypatch.setattr(zoo, "_process", lambda *a: pytest.fail("a process was started"))
    args = child_args("--models", "fake", "--modes", "eager,spmd", "--json", str(tmp_path / "z.json"),
                      "--markdown", str(tmp_path / "z.md"))
    assert cli.main(["zoo", "--models", "fake", "--modes", "eager,spmd", "--json", args.json,
                     "--markdown", args.markdown]) == 0
    rows = json.loads((tmp_path / "z.json").read_text())["rows"]
    assert [(r["mode"], r["cold"]["status"]) for r in rows] == [("eager", "skipped"), ("spmd", "skipped")]
    assert "no_such_zoo_library" in rows[0]["cold"]["reason"] and "pip install 'spmd[bench]'" in rows[0]["cold"]["reason"]
    assert (tmp_path / "z.md").read_text().count("skipped: needs no_such_zoo_library") == 2
