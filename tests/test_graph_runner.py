"""The bucketing, padding and replay of decode steps (engine/core/graph_runner.py), checked on the CPU: the
padded batch run eagerly, and a stand-in for CUDA graph capture that replays on the captured (static)
inputs, so every input a step needs must be copied into them. Outputs stay exactly plain decoding's.
Start-up captures every shape a step takes, and serving captures none; `auto` picks the fast path."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch

from engine.attention import resolve_backend
from engine.config import ServerArgs
from engine.core.graph_runner import CudaGraph, StepGraphs, _dummy_batch, _key, buckets, capture_shapes, step_shapes
from tests.drafts import ALGOS, draft_setup
from tests.tiny import make_model, random_prompts, tiny_engine

GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


def test_buckets():
    assert buckets(32) == [1, 2, 4, 8, 16, 24, 32] and buckets(5) == [1, 2, 4, 5] and buckets(1) == [1]


class ReplayingGraph(CudaGraph):
    """What a CUDA graph does, on the CPU: replay runs fn on the captured batch's tensors and writes
    the results into the captured outputs."""

    def _capture(self, pool):
        return self.fn(self.static)

    def _replay(self) -> None:
        hidden, captured = self.fn(self.static)
        self.out[0].copy_(hidden)
        for i, h in captured.items():
            self.out[1][i].copy_(h)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("target"), "llama", seed=3)


# n-gram trees vary: eager. Replaying graphs runs the Triton backend in its interpreter (most of a minute
# a drafter): plain decoding's by default, the drafters' under -m slow and on a GPU (gpu_check.sh).
@pytest.mark.parametrize("algo, capture", [
    pytest.param(algo, capture, id=f"{algo}-{'replayed' if capture else 'padded'}",
                 marks=[pytest.mark.slow] if capture and algo else [])
    for capture in (None, ReplayingGraph) for algo in [None] + [a for a in ALGOS if a != "NGRAM"]])
def test_bucketed_decode_is_lossless(algo, capture, target, tmp_path):
    prompts = random_prompts(5, seed=4)
    spec = {} if algo is None else draft_setup(algo, target, tmp_path)
    model = spec.pop("model_path", target)
    reference = tiny_engine(model, algo, tree=(3, 2, 6), **spec)
    expected = [o["output_ids"] for o in reference.generate(input_ids=prompts, sampling_params=GREEDY)]
    if capture is not None:         # graphs need metadata shaped by the bucket alone: the Triton backend's
        pytest.importorskip("triton")
        spec["attention_backend"] = "triton"
    eng = tiny_engine(model, algo, tree=(3, 2, 6), **spec)
    runner, kv = eng.debug.target, eng.debug.kv
    graphs = runner.graphs = StepGraphs(runner.run_model, runner.backend.prepare, 8, kv.pad_row, kv.pad_slot,
                                        capture)
    sizes = []
    run = graphs.run
    graphs.run = lambda batch, size: sizes.append((batch.batch_size, size)) or run(batch, size)
    assert [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)] == expected
    assert (5, 8) in sizes and all(size == min(b for b in buckets(8) if b >= n) for n, size in sizes)
    assert eng.stats()["kv_tokens_used"] == 0


@pytest.mark.parametrize("algo, weights", [(None, {}), ("EAGLE3", {}), (None, {"quantization": "w4a8", "dtype": "bfloat16"})])
def test_compiled_decode_gives_the_same_tokens(algo, weights, target, tmp_path):
    """--enable-torch-compile: decode and verify run compiled (one dynamic graph, warmed up at start);
    quantized linears and bf16 elementwise steps run their C kernels as opaque ops in it."""
    prompts = random_prompts(4, seed=9)
    spec = {**weights, **({} if algo is None else draft_setup(algo, target, tmp_path))}
    expected = [o["output_ids"] for o in tiny_engine(target, algo, tree=(3, 2, 6), **spec).generate(
        input_ids=prompts, sampling_params=GREEDY)]
    eng = tiny_engine(target, algo, tree=(3, 2, 6), enable_torch_compile=True, torch_compile_max_bs=4, **spec)
    calls = []
    fn = eng.debug.target.graphs.fn
    eng.debug.target.graphs.fn = lambda batch: calls.append(batch.batch_size) or fn(batch)
    assert [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)] == expected
    assert 4 in calls


def test_captured_inputs_outlive_the_callers_batch(target):
    """A CUDA graph reads its inputs by address: when the caller prepares the batch it was captured on
    again (new attention metadata), the tensors the graph reads must stay alive, or a replay reads
    freed memory (on a GPU: an illegal memory access)."""
    pytest.importorskip("triton")
    eng = tiny_engine(target, attention_backend="triton")
    runner, kv = eng.debug.target, eng.debug.kv
    graphs = StepGraphs(runner.run_model, runner.backend.prepare, 4, kv.pad_row, kv.pad_slot, ReplayingGraph)
    with torch.inference_mode():
        batch = _dummy_batch(kv, 4, 1, None, torch.full((4,), kv.pad_slot, dtype=torch.long))
        graphs.run(batch, 4)                                  # a full bucket: captured on this batch
        read = [weakref.ref(t) for t in vars(batch.attn).values() if isinstance(t, torch.Tensor)]
        runner.backend.prepare(batch)
        del batch
        gc.collect()
        assert read and all(r() is not None for r in read)
        graphs.run(_dummy_batch(kv, 4, 1, None, torch.full((4,), kv.pad_slot, dtype=torch.long)), 4)   # replays


def test_step_shapes_are_every_tree_size_the_sizing_can_choose():
    plain = [(1, False)]
    assert step_shapes(1, 1, True, False) == plain                                         # no model drafter
    assert step_shapes(4, 1, False, False) == plain + [(4, False)]                         # a whole chain
    assert step_shapes(4, 1, True, False) == plain + [(2, False), (3, False), (4, False)]
    assert step_shapes(8, 4, True, False) == plain + [(n, True) for n in range(2, 9)]      # (5, 4, 8) sized
    assert step_shapes(8, 4, False, False) == plain + [(8, True)]
    assert step_shapes(8, 4, True, True) == plain                                          # nodes as decode rows


class EagerGraph:
    """A stand-in capture that records what is captured and runs the forward on the batch it is given
    (the torch backend's metadata varies with the context: the shape's coverage is what is checked)."""

    captured: list = []

    def __init__(self, fn, batch):
        self.fn = fn
        EagerGraph.captured.append(_key(batch, batch.batch_size))

    def __call__(self, batch):
        return self.fn(batch)


@pytest.mark.parametrize("algo, adaptive", [("STANDALONE", "on"), ("EAGLE3", "on"), ("EAGLE3", "off")])
def test_start_up_captures_every_shape_a_step_takes_and_serving_none(algo, adaptive, target, tmp_path):
    """Sized drafts (STANDALONE drafting with the target itself; EAGLE-3 with a random head, whose steps
    return the hidden states the head reads) and whole trees: every uniform decode or verify step of up
    to --cuda-graph-max-bs requests finds a graph captured at start-up, and none is captured after. The
    sizes chosen depend on timings: whole trees (off) make sure verify steps run."""
    spec = {"speculative_draft_model_path": str(target)} if algo == "STANDALONE" else draft_setup(algo, target, tmp_path)
    eng = tiny_engine(target, algo, tree=(3, 2, 6), speculative_adaptive=adaptive, **spec)
    runner, kv, worker = eng.debug.target, eng.debug.kv, eng.debug.worker
    graphs = runner.graphs = StepGraphs(runner.run_model, runner.backend.prepare, 4, kv.pad_row, kv.pad_slot,
                                        EagerGraph)
    EagerGraph.captured = []
    capture_shapes(eng.args, runner, kv, worker.num_draft_tokens, worker.capture_hidden)
    at_start = list(EagerGraph.captured)
    assert len(at_start) == len(graphs.sizes) * len(step_shapes(6, 2, adaptive == "on", False))
    seen = []
    bucket = graphs.bucket
    graphs.bucket = lambda batch: seen.append(batch) or bucket(batch)
    eng.generate(input_ids=random_prompts(4, seed=5), sampling_params=GREEDY)
    eng.generate(input_ids=random_prompts(1, seed=6), sampling_params={**GREEDY, "max_new_tokens": 24})
    assert EagerGraph.captured == at_start, "a graph was captured while serving"
    uniform = [b for b in seen if len(set(b.extend_lens)) == 1 and b.extra_lens is None]
    assert adaptive == "on" or any(b.extend_lens[0] > 1 for b in uniform), "no verify step: the test checks nothing"
    missing = {_key(b, bucket_size(graphs, b)) for b in uniform} - set(at_start)
    assert not missing, f"steps of shapes not captured at start-up: {missing}"


def bucket_size(graphs: StepGraphs, batch) -> int:
    return next(s for s in graphs.sizes if s >= batch.batch_size)


def test_an_uncaptured_shape_runs_eagerly_once_sealed(target, caplog):
    eng = tiny_engine(target)
    runner, kv = eng.debug.target, eng.debug.kv
    graphs = StepGraphs(runner.run_model, runner.backend.prepare, 4, kv.pad_row, kv.pad_slot, EagerGraph)
    graphs.sealed = True
    with torch.inference_mode(), caplog.at_level(logging.DEBUG, logger="engine.core.graph_runner"):
        batch = _dummy_batch(kv, 3, 2, None, torch.full((6,), kv.pad_slot, dtype=torch.long))
        assert graphs.bucket(batch) is None
    assert "runs eagerly" in caplog.text


def test_auto_backend_is_triton_with_graphs_on_cuda_and_torch_on_the_cpu(monkeypatch, caplog):
    """Pure logic: resolved for a CUDA device without one."""
    import spec_kernels.paged_attention as paged

    monkeypatch.setattr(paged, "available", lambda: True)
    assert resolve_backend("auto", "cuda") == resolve_backend("auto", "cuda:1") == "triton"
    assert resolve_backend("auto", "cpu") == "torch"
    assert resolve_backend("torch", "cuda") == "torch" and resolve_backend("triton", "cpu") == "triton"
    config = make_config()
    args = ServerArgs(cuda_graph_max_bs=8)
    assert args.resolved(config, "cuda").attention_backend == "triton"
    assert not args.resolved(config, "cuda").disable_cuda_graph
    assert args.resolved(config, "cpu").attention_backend == "torch"
    assert ServerArgs(attention_backend="torch").resolved(config, "cuda").attention_backend == "torch"
    monkeypatch.setattr(paged, "available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="engine.attention"):
        assert resolve_backend("auto", "cuda") == "torch"
    assert "triton is not installed" in caplog.text


def make_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=320, max_position_embeddings=512)
