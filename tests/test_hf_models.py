"""Hugging Face models train as eager does, and a captured CUDA graph stays captured.

A CUDA graph reads parameters, buffers and optimizer state in place, so their storage must stay where
it was from one call to the next (``spmd.lower.cudagraphs``). On the CPU the runner's bookkeeping
runs with a stand-in for the capture (``CpuGraphRunner``): the same inputs are held as static, the
same check for moved ones runs, and ``cuda_graph_captures`` counts. The GPU test runs the real thing.
Tiny configs, no weights, no network; ``transformers`` is optional (the tests that need it skip).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn

import spmd
import spmd.lower.lowering as lowering
from spmd.lower.cudagraphs import CudaGraphRunner
from tests.parity import train_step

F64 = torch.float64
TOL = 1e-10


class _Replay:
    """What ``CpuGraphRunner`` captures: a replay runs the function on the inputs held at the capture."""

    def __init__(self, runner: "CpuGraphRunner"):
        self.runner = runner

    def replay(self) -> None:
        self.runner.static_outputs = tuple(self.runner.fn(*self.runner.static_inputs))


class CpuGraphRunner(CudaGraphRunner):
    """``CudaGraphRunner`` on the CPU: the capture holds the inputs as the real one does, runs the step once
    (as the real one does, graph by graph) and counts."""

    def _check_inputs(self, args: tuple) -> None:
        pass

    def _capture(self, args: tuple) -> None:
        self.static_inputs = [a if p else a.clone() for a, p in zip(args, self.persistent)]
        self.pointers = [a.data_ptr() for a, p in zip(args, self.persistent) if p]
        self.graph = _Replay(self)
        self.graph.replay()
        self.captures += 1


@pytest.fixture
def cpu_graphs(monkeypatch):
    """Lowering with ``cudagraphs=True`` makes ``CpuGraphRunner``s (on the CPU, nothing stands in its way)."""
    monkeypatch.setattr(lowering, "CudaGraphRunner", CpuGraphRunner)
    monkeypatch.setattr(lowering, "cudagraph_obstacle", lambda gm, args: None)
    return spmd.GraphModuleTransformation(enable_graph_optimization=True, enable_cudagraphs=True)


def lm_loss(model, ids, labels=None, attention_mask=None):
    """A Hugging Face model's loss on ``ids`` (a causal LM's labels are its inputs; a seq2seq model's are given)."""
    return model(input_ids=ids, labels=ids if labels is None else labels, attention_mask=attention_mask).loss


def _update(optim, loss):
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def lm_step(model, optim, ids, labels=None):
    return _update(optim, lm_loss(model, ids, labels))


def bf16_lm_step(model, optim, ids, labels=None):
    """``lm_step`` with the forward in bfloat16 autocast on the batch's device, as the benchmark runs it."""
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        loss = lm_loss(model, ids, labels)
    return _update(optim, loss)


def tiny_llama(**overrides):
    transformers = pytest.importorskip("transformers")
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    config = transformers.LlamaConfig(**{**shape, **overrides})
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(F64)


def assert_trains_like_eager(step, model, ref, optim, ref_optim, batches, eager=lm_step):
    for batch in batches:
        loss, ref_loss = step(model, optim, batch), eager(ref, ref_optim, batch)
        assert (loss - ref_loss).abs().item() <= TOL, (loss.item(), ref_loss.item())
    worst = max((a - b).abs().max().item() for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    assert worst <= TOL, worst


class Rebinds(nn.Module):
    """Rebinds a buffer and a plain tensor attribute on every call, as eager code does
    (``self.calls = self.calls + 1``), and reads both."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4, dtype=F64)
        self.register_buffer("calls", torch.zeros((), dtype=F64))
        self.scale = torch.ones(4, dtype=F64)

    def forward(self, x):
        self.calls = self.calls + 1
        self.scale = self.scale * 0.5 + self.calls
        return self.fc(x) * self.scale


def test_a_buffer_or_attribute_the_step_rebinds_is_updated_in_place_as_eager_leaves_it(cpu_graphs):
    model = Rebinds()
    ref = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.AdamW(m.parameters(), lr=0.1) for m in (model, ref))
    step = spmd.compile(gm_transformation=cpu_graphs)(train_step)
    calls, scale = model.calls, model.scale
    pointers = (calls.data_ptr(), scale.data_ptr())
    assert_trains_like_eager(step, model, ref, optim, ref_optim, [torch.randn(2, 4, dtype=F64) for _ in range(4)],
                             eager=train_step)
    assert model.calls.item() == ref.calls.item() == 4.0
    assert torch.equal(model.scale, ref.scale)
    assert model.calls is calls and model.scale is scale, "the step's write rebound the module's tensor"
    assert (calls.data_ptr(), scale.data_ptr()) == pointers
    assert step.trace_count == 1 and step.cuda_graph_captures == 1


class Reshapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4, dtype=F64)
        self.register_buffer("seen", torch.zeros(1, dtype=F64))

    def forward(self, x):
        self.seen = torch.cat([self.seen, x.sum().reshape(1)])  # grows: cannot be written in place
        return self.fc(x)


def test_a_buffer_rebound_to_another_shape_is_named_and_left_as_it_was(caplog):
    model = Reshapes()
    seen = model.seen
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="spmd"):
        spmd.compile()(train_step)(model, optim, torch.randn(2, 4, dtype=F64))
    assert "rebinds buffer seen to a tensor of shape (2,)" in caplog.text, caplog.text
    assert model.seen is seen and model.seen.shape == (1,)


def test_hf_llama_keeps_every_graph_input_in_place_and_trains_like_eager(cpu_graphs):
    """Tiny Llama with rotary embeddings (``inv_freq``, ``original_inv_freq`` buffers): one capture over
    several calls, the storage of every parameter, buffer and state tensor unchanged, eager's numbers."""
    model = tiny_llama()
    ref = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    step = spmd.compile(gm_transformation=cpu_graphs)(lm_step)
    batches = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(k)) for k in range(2)]
    assert_trains_like_eager(step, model, ref, optim, ref_optim, batches[:1])
    held = [*model.parameters(), *model.buffers(), *(t for st in optim.state.values() for t in st.values())]
    pointers = [t.data_ptr() for t in held]
    assert_trains_like_eager(step, model, ref, optim, ref_optim, batches * 2)
    assert [t.data_ptr() for t in held] == pointers
    assert step.trace_count == 1 and step.cuda_graph_captures == 1


def test_a_tensor_rebound_between_calls_is_named_once_when_the_graph_is_captured_again(cpu_graphs, caplog):
    model = tiny_llama()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = spmd.compile(gm_transformation=cpu_graphs)(lm_step)
    ids = torch.randint(0, 64, (2, 8))
    rotary = model.model.rotary_emb
    with caplog.at_level(logging.INFO, logger="spmd.lower.cudagraphs"):
        for _ in range(3):
            step(model, optim, ids)
        for _ in range(2):
            rotary.inv_freq = rotary.inv_freq.clone()  # a new tensor in its place: the graph reads another storage
            step(model, optim, ids)
    again = [r for r in caplog.records if "again" in r.getMessage()]
    assert [r.levelno for r in again] == [logging.WARNING, logging.INFO], caplog.text
    assert "model.rotary_emb.inv_freq (another tensor now holds its place" in again[0].getMessage()
    assert step.cuda_graph_captures == 3


def test_hf_llama_gqa_in_bf16_trains_bit_for_bit_as_eager():
    """bf16 parameters, grouped-query attention through SDPA, AdamW: parameters after each step and the
    gradients of a last backward equal eager's bit for bit; the float32 loss (a reduction over the
    tokens, whose CPU kernel may round its tail differently) to an ulp. (With an ``attention_mask`` they
    need not: see ``test_hf_llama_gqa_with_an_attention_mask_computes_what_hf_computes_when_traced``.)"""
    model = tiny_llama(attn_implementation="sdpa").to(torch.bfloat16)
    ref = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    step = spmd.compile()(lm_step)
    for k in range(3):
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(k))
        torch.testing.assert_close(step(model, optim, ids), lm_step(ref, ref_optim, ids).detach(), rtol=1e-6, atol=0)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters())), k
    backward = spmd.compile()(_backward_only)
    backward(model, ids)
    _backward_only(ref, ids)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))


def _backward_only(model, ids, attention_mask=None):
    loss = lm_loss(model, ids, attention_mask=attention_mask)
    loss.backward()
    return loss


def test_hf_llama_gqa_with_an_attention_mask_computes_what_hf_computes_when_traced(monkeypatch):
    """Given an all-ones ``attention_mask``, eager HF looks at its values and drops it (SDPA with
    ``is_causal=True`` and ``enable_gqa=True``); traced, it cannot (``is_tracing`` is true of fake tensors),
    so the step keeps the mask and repeats K/V per query head (``repeat_kv``), whose gradient is rounded
    to bf16 per head before the group's sum. Eager made to keep the mask too computes spmd's bits."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    model = tiny_llama(attn_implementation="sdpa").to(torch.bfloat16)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    spmd.compile()(_backward_only)(model, ids, mask)
    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", lambda *args, **kwargs: False)
    _backward_only(ref, ids, mask)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))


def tiny_t5():
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config)


def test_hf_t5_trains_like_eager_in_float64():
    model = tiny_t5().to(F64)
    ref = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    step = spmd.compile()(lm_step)
    ids, labels = torch.randint(1, 64, (2, 8)), torch.randint(1, 64, (2, 6))
    for _ in range(3):
        loss, ref_loss = step(model, optim, ids, labels), lm_step(ref, ref_optim, ids, labels)
        assert (loss - ref_loss).abs().item() <= TOL
    worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    assert worst <= TOL, worst


def test_hf_t5_in_bf16_autocast_is_a_graph_inductor_can_take():
    """The step graph of T5 under bf16 autocast, prepared for Inductor (its decompositions applied node by
    node), still propagates: each view in it is one (``spmd.lower.decompose_for_inductor``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from spmd.lower.rewrites import prepare_for_inductor

    model = tiny_t5()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = spmd.compile()(bf16_lm_step)
    graph = step.lower(model, optim, torch.randint(1, 64, (2, 8)), torch.randint(1, 64, (2, 6))).graph
    prepared = prepare_for_inductor(graph, decompose=True)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fakes = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                 for v in (n.meta["val"] for n in prepared.graph.find_nodes(op="placeholder"))]
    with torch.no_grad():
        FakeTensorProp(prepared, mode=mode).propagate_dont_convert_inputs(*fakes)


def tiny_mixtral(experts_implementation: str):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers.PreTrainedModel, "get_correct_experts_implementation"):
        pytest.skip("this transformers has one MoE implementation, the loop over the experts hit")
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64,
                                        experts_implementation=experts_implementation)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).to(F64)


def test_hf_mixtral_with_batched_experts_trains_like_eager():
    """``experts_implementation="batched_mm"`` (every token through its top-k experts' weights, gathered: no
    data-dependent shape)."""
    model = tiny_mixtral("batched_mm")
    ref = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    batches = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(k)) for k in range(3)]
    assert_trains_like_eager(spmd.compile()(lm_step), model, ref, optim, ref_optim, batches)


def test_hf_mixtral_with_grouped_experts_trains_like_eager_in_float64():
    """``grouped_mm``, the default: while tracing, transformers sends float64 experts through its grouped-matmul
    op, whose backward reads the routing on the host (in the trace up to transformers 5.17); spmd traces it as a
    masked matmul per expert (``spmd.trace.grouped_mm``). Eager float64 has no grouped_mm kernel on the CPU, so
    the reference is the same model with ``batched_mm`` experts: the same function, each token through its
    experts' weights."""
    model = tiny_mixtral("grouped_mm")
    ref = copy.deepcopy(model)
    ref.set_experts_implementation("batched_mm")
    optim, ref_optim = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    batches = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(k)) for k in range(3)]
    assert_trains_like_eager(spmd.compile()(lm_step), model, ref, optim, ref_optim, batches)


def test_hf_mixtral_looping_over_the_experts_hit_is_refused_as_data_dependent():
    """HF's eager experts loop (``for expert_idx in expert_hit``, ``expert_hit = (...).nonzero()``) runs as
    many iterations as there are experts with tokens: a value no whole-step graph holds."""
    model = tiny_mixtral("eager")
    with pytest.raises(spmd.SpmdCompileError, match="reads the value of a tensor"):
        spmd.compile()(lm_step)(model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.randint(0, 64, (2, 8)))


def test_cuda_graph_captures_is_zero_without_cuda_graphs():
    model = Rebinds()
    step = spmd.compile()(train_step)
    step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 4, dtype=F64))
    assert step.cuda_graph_captures == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hf_llama_bf16_is_captured_once_per_graph_on_the_gpu(caplog):
    """The benchmark's setting: bf16 autocast, fused capturable AdamW, ``spmd.compile()``'s GPU default
    (Inductor, CUDA graphs). After warm-up, the count of captures stays put."""
    model = tiny_llama().float().cuda()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    step = spmd.compile()(bf16_lm_step)
    ids = torch.randint(0, 64, (2, 16), device="cuda")
    with caplog.at_level(logging.INFO, logger="spmd"):
        for _ in range(3):
            step(model, optim, ids)
        warm = step.cuda_graph_captures
        for _ in range(5):
            step(model, optim, ids)
    assert warm >= 1 and step.cuda_graph_captures == warm, caplog.text
    assert "as a CUDA graph again" not in caplog.text and "without CUDA graphs" not in caplog.text, caplog.text


def test_hf_llama_lowered_by_inductor_reads_its_shifted_labels_from_memory_and_trains_like_eager(monkeypatch):
    """HF's causal-LM loss shifts the labels inside the step; under Inductor the loss reads them through the
    ``write_loss_targets_to_memory`` rewrite (``spmd.lower.loss_targets``), and the whole step (SGD with momentum)
    trains as eager does. HF takes the loss over ``logits.float()``, float32 even in a float64 model, and Inductor
    reduces it in another order than eager: the tolerance is float32's (the rewrite alone changes no value:
    ``tests/test_loss_lowering.py`` compares its graph with eager's to 1e-12 in float64)."""
    from spmd.lower import rewrites

    written, write = [], rewrites.write_loss_targets_once
    monkeypatch.setattr(rewrites, "write_loss_targets_once", lambda graph: written.append(write(graph)) or written[-1])
    model = tiny_llama(num_hidden_layers=1)
    ref = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(
        enable_graph_optimization=True, enable_inductor=True))(lm_step)
    gen = torch.Generator().manual_seed(3)
    for ids in [torch.randint(0, 64, (2, 8), generator=gen) for _ in range(3)]:
        loss, ref_loss = step(model, optim, ids), lm_step(ref, ref_optim, ids)
        assert loss.dtype == torch.float32 and abs(loss.item() - ref_loss.item()) <= 1e-5, (loss, ref_loss)
    worst = max((a - b).abs().max().item() for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    assert worst <= 1e-6, worst
    assert written == [1], written  # the step graph's one targets value, computed in the step


def test_hf_llama_is_cut_into_pieces_compiled_side_by_side_and_trains_like_eager():
    """transformers' ``DynamicCache`` starts each layer's keys and values as ``torch.tensor([])``: a module
    attribute of the traced graph, which kept the step whole (its pieces could not travel to a compile worker).
    Made by an op instead (``spmd.lower.graph_constants``), the step is cut into pieces, one compiled by a worker
    process, and trains as eager does (SGD with momentum; float32's tolerance, as HF's loss is taken over
    ``logits.float()``: see the test above)."""
    model = tiny_llama(num_hidden_layers=2)
    ref = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(
        enable_graph_optimization=True, enable_inductor=True, compile_pieces=2), cache_dir=False)(lm_step)
    gen = torch.Generator().manual_seed(3)
    for ids in [torch.randint(0, 64, (2, 8), generator=gen) for _ in range(3)]:
        loss, ref_loss = step(model, optim, ids), lm_step(ref, ref_optim, ids)
        assert abs(loss.item() - ref_loss.item()) <= 1e-5, (loss, ref_loss)
    worst = max((a - b).abs().max().item() for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    assert worst <= 1e-6, worst
    pieces = {k.split("/")[2] for k in step.compile_times if k.startswith("lower/step/") and k.split("/")[2].isdigit()}
    assert len(pieces) >= 2 and any(k.endswith("/worker") for k in step.compile_times), sorted(step.compile_times)
