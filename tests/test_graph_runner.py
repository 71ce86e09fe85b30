"""The bucketing, padding and replay of decode steps (engine/graph_runner.py), checked on the CPU: the
padded batch run eagerly, and a stand-in for CUDA graph capture that replays on the captured (static)
inputs, so every input a step needs must be copied into them. Outputs stay exactly plain decoding's."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from engine.graph_runner import StepGraphs, _dummy_batch, buckets
from tests.test_speculative_lossless import ALGOS, draft_setup
from tests.tiny import make_model, random_prompts, tiny_engine

GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


def test_buckets():
    assert buckets(32) == [1, 2, 4, 8, 16, 24, 32] and buckets(5) == [1, 2, 4, 5] and buckets(1) == [1]


def replaying_capture(fn, batch):
    """What a CUDA graph does, on the CPU: replay runs fn on the captured batch's tensors and writes
    the results into the captured outputs."""
    out = fn(batch)

    def replay():
        hidden, captured = fn(batch)
        out[0].copy_(hidden)
        for i, h in captured.items():
            out[1][i].copy_(h)

    return replay, out


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("target"), "llama", seed=3)


# n-gram trees vary: eager. Replaying graphs runs the Triton backend in its interpreter (most of a minute
# a drafter): plain decoding's by default, the drafters' under -m slow and on a GPU (gpu_check.sh).
@pytest.mark.parametrize("algo, capture", [
    pytest.param(algo, capture, id=f"{algo}-{'replayed' if capture else 'padded'}",
                 marks=[pytest.mark.slow] if capture and algo else [])
    for capture in (None, replaying_capture) for algo in [None] + [a for a in ALGOS if a != "NGRAM"]])
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
    runner, kv = eng._target, eng._kv
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
    fn = eng._target.graphs.fn
    eng._target.graphs.fn = lambda batch: calls.append(batch.batch_size) or fn(batch)
    assert [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)] == expected
    assert 4 in calls


def test_captured_inputs_outlive_the_callers_batch(target):
    """A CUDA graph reads its inputs by address: when the caller prepares the batch it was captured on
    again (new attention metadata), the tensors the graph reads must stay alive, or a replay reads
    freed memory (on a GPU: an illegal memory access)."""
    pytest.importorskip("triton")
    eng = tiny_engine(target, attention_backend="triton")
    runner, kv = eng._target, eng._kv
    graphs = StepGraphs(runner.run_model, runner.backend.prepare, 4, kv.pad_row, kv.pad_slot, replaying_capture)
    with torch.inference_mode():
        batch = _dummy_batch(kv, 4, 1, None, torch.full((4,), kv.pad_slot, dtype=torch.long))
        graphs.run(batch, 4)                                  # a full bucket: captured on this batch
        read = [weakref.ref(t) for t in vars(batch.attn).values() if isinstance(t, torch.Tensor)]
        runner.backend.prepare(batch)
        del batch
        gc.collect()
        assert read and all(r() is not None for r in read)
        graphs.run(_dummy_batch(kv, 4, 1, None, torch.full((4,), kv.pad_slot, dtype=torch.long)), 4)   # replays
