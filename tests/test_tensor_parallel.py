"""Tensor parallelism on CPU: two gloo ranks in two local processes against one process.

- Logits (as logprobs) agree within fp32 reduction error, and greedy outputs are identical, plain and
  under every speculative algorithm; drafts that predict a bigram target exactly are accepted as much
  as on one process (their sharded embedding, layers and heads compute what the whole ones do).
- int4 and w8a8_int8 weights are quantized per rank, each its block.
- Predicted Outputs verify their chains in the sharded forward, with plain decoding's output.
- A rank that fails to start, or dies, ends the engine with an error naming it, within seconds.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest

from engine import Engine
from engine.errors import ConfigError, DistributedError
from spec_kernels import cpu_w4a8
from tests import eagle_checkpoints as ckpt
from tests.drafts import ALGOS, draft_setup
from tests.lossless import GREEDY, prompts
from tests.planning import untimed
from tests.tiny import make_model

TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("target"), "llama", seed=3)


def engine(model, tp: int = 1, **kw) -> Engine:
    return Engine(planner=untimed, model_path=str(model), dtype="float32", max_total_tokens=4096, tp_size=tp, **kw)


def greedy(eng: Engine, **params) -> list[dict]:
    return eng.generate(input_ids=prompts(), sampling_params={**GREEDY, **params}, return_logprob=True,
                        top_logprobs_num=5)


@pytest.fixture(scope="module")
def plain(target):
    with engine(target) as eng:
        return greedy(eng)


def test_logits_within_fp32_tolerance_and_greedy_identical(target, plain):
    with engine(target, tp=2) as eng:
        assert eng.kv_capacity == 4096
        outs = greedy(eng)
        # Switching the algorithm loads the same draft on every rank.
        eng.set_speculative(speculative_algorithm="NGRAM", **TREE)
        switched = eng.generate(input_ids=prompts(), sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
    assert [o["output_ids"] for o in switched] == [o["output_ids"] for o in plain]
    for got, want in zip(outs, plain):
        for (lp, _, _), (ref, _, _) in zip(got["meta_info"]["output_token_logprobs"],
                                           want["meta_info"]["output_token_logprobs"]):
            assert lp == pytest.approx(ref, abs=1e-4)
        for top, ref_top in zip(got["meta_info"]["output_top_logprobs"], want["meta_info"]["output_top_logprobs"]):
            assert [t for _, t, _ in top] == [t for _, t, _ in ref_top]
            assert [v for v, _, _ in top] == pytest.approx([v for v, _, _ in ref_top], abs=1e-4)


@pytest.mark.parametrize("algo", ALGOS)
def test_speculative_greedy_identical(algo, target, plain, tmp_path):
    kw = {"model_path": str(target), **draft_setup(algo, target, tmp_path)}
    with Engine(planner=untimed,
                dtype="float32", max_total_tokens=4096, tp_size=2, speculative_algorithm=algo, **TREE, **kw) as eng:
        outs = eng.generate(input_ids=prompts(), sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)


def test_predictions_under_tensor_parallelism(target, plain):
    """Predicted Outputs' chains are verified in the sharded forward: exact and edited predictions
    (a deletion) leave greedy output plain decoding's, and are accepted."""
    expected = [o["output_ids"] for o in plain]
    predictions = [ids if i % 2 else ids[:8] + ids[11:] for i, ids in enumerate(expected)]
    with engine(target, tp=2) as eng:
        outs = eng.generate(input_ids=prompts(), sampling_params=[{**GREEDY, "prediction": p} for p in predictions])
    assert [o["output_ids"] for o in outs] == expected
    assert all(o["meta_info"]["accepted_prediction_tokens"] >= 8 for o in outs)


@pytest.mark.parametrize("algo", ["EAGLE", "MTP", "STANDALONE"])
def test_exact_drafts_are_accepted_as_on_one_process(algo, tmp_path):
    """A bigram target, and drafts that predict it exactly: every draft token is accepted, so a
    wrongly sharded draft embedding, layer or head would show as a shorter accept length."""
    target = ckpt.make_bigram_target(make_model(tmp_path / "target", "llama", seed=5))
    kw = {"speculative_algorithm": algo, "speculative_num_steps": 3, "speculative_eagle_topk": 1,
          "speculative_num_draft_tokens": 4, "speculative_adaptive": "off"}
    if algo == "EAGLE":
        kw["speculative_draft_model_path"] = str(ckpt.save_eagle_repo(tmp_path / "draft", *ckpt.exact_eagle_tensors(target)))
    elif algo == "MTP":
        target = ckpt.save_mtp_target(tmp_path / "mtp", target, "nextn", exact=True)
    else:
        kw["speculative_draft_model_path"] = str(target)
    accepted = []
    for tp in (1, 2):
        with engine(target, tp=tp, **kw) as eng:
            eng.generate(input_ids=prompts(), sampling_params=GREEDY)
            accepted.append(eng.stats()["avg_spec_accept_length"])
    assert accepted[0] == accepted[1] == pytest.approx(4.0, abs=0.2)


CLASSES = {"int4": "Int4Linear", "w8a8_int8": "W8A8Linear", "w4a8": "W4A8Linear"}


@pytest.mark.parametrize("kind", ["int4", "w8a8_int8", "w4a8"])
def test_quantized_weights_are_quantized_after_sharding(kind, target):
    """Each rank quantizes its block (int4's partial sums come out of the kernel in bf16; w8a8_int8 scales
    each rank's slice of a row-parallel input on its own), so the logprobs agree with one process's to
    that rounding, not to fp32's: within 0.05 for int4 and 0.1 for w8a8_int8 here; a wrong block would
    be off by whole units."""
    args = dict(input_ids=prompts(), sampling_params={**GREEDY, "max_new_tokens": 1}, return_logprob=True,
                top_logprobs_num=5)
    with engine(target, quantization=kind) as one, engine(target, tp=2, quantization=kind) as two:
        layer = two.debug.target.model.model.layers[0]
        assert type(layer.mlp.down_proj).__name__ == type(layer.self_attn.qkv_proj).__name__ == CLASSES[kind]
        for got, want in zip(two.generate(**args), one.generate(**args)):
            top, ref = got["meta_info"]["output_top_logprobs"][0], want["meta_info"]["output_top_logprobs"][0]
            assert [v for v, _, _ in top] == pytest.approx([v for v, _, _ in ref], abs={"int4": 0.05}.get(kind, 0.1))


@pytest.mark.parametrize("six_bits", [False, True])
def test_gguf_groups_are_cut_by_rank(six_bits, tmp_path, monkeypatch):
    """A GGUF's own 4-bit layers, served sharded: every rank's block of them stays 4-bit (w4a8, or int4
    without VNNI); with Q4_K gate/up and embedding, Q6_K down projections and head, those stay as stored
    under w4a8 (the head and the embedding cut by vocabulary, their last blocks padded)."""
    from tests.gguf_files import gguf_tokenizer, tiny_llama, write_tiny_gguf

    if six_bits and cpu_w4a8.kernel_name() != "avx512-vnni":
        pytest.skip("Q6_K layers are served as they are under w4a8, the default with AVX-512 VNNI")
    monkeypatch.setenv("SPEC_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = gguf_tokenizer()
    path = tmp_path / "tiny.Q4.gguf"
    types = {"q_proj": "Q4_0", "k_proj": "Q4_0", "v_proj": "Q4_0", "o_proj": "Q4_1", "gate_proj": "Q4_1",
             "up_proj": "Q4_1", "down_proj": "Q4_0"}
    sizes = {}
    if six_bits:        # down_proj's 512 inputs: a super-block of 256 per rank
        types.update(gate_proj="Q4_K", up_proj="Q4_K", down_proj="Q6_K", lm_head="Q6_K", embed_tokens="Q4_K")
        sizes = dict(hidden_size=256, intermediate_size=512)
    write_tiny_gguf(path, tiny_llama(len(tokenizer), **sizes), tokenizer, types)
    args = dict(input_ids=[5, 6, 7, 8], sampling_params={**GREEDY, "max_new_tokens": 1}, return_logprob=True,
                top_logprobs_num=5)
    with Engine(planner=untimed, model_path=str(path), max_total_tokens=2048) as one, \
            Engine(planner=untimed, model_path=str(path), max_total_tokens=2048, tp_size=2) as two:
        model = two.debug.target.model
        layer = model.model.layers[1]
        kinds = {type(m).__name__ for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj)}
        assert kinds == {CLASSES["w4a8" if cpu_w4a8.kernel_name() == "avx512-vnni" else "int4"]}
        if six_bits:
            assert type(layer.mlp.down_proj).__name__ == type(model.quant_head).__name__ == "Q6KLinear"
            assert type(model.model.embed_tokens).__name__ == "GroupEmbedding"
        else:
            assert type(layer.mlp.down_proj).__name__ in kinds
        top, ref = (e.generate(**args)["meta_info"]["output_top_logprobs"][0] for e in (two, one))
    assert [v for v, _, _ in top] == pytest.approx([v for v, _, _ in ref], abs=0.05)


@pytest.mark.slow
def test_compiled_forward_under_tensor_parallelism(target, plain):
    """--enable-torch-compile: each rank compiles its block's forward, collectives included."""
    with engine(target, tp=2, enable_torch_compile=True) as eng:
        outs = eng.generate(input_ids=prompts(), sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]


def test_a_size_that_does_not_divide_the_heads_is_refused(target):
    with pytest.raises(ConfigError, match="--tp-size 3 must divide the model's attention heads"):
        engine(target, tp=3)


# ---------------------------------------------------------------------------------------- failures
def _rank(n: int) -> multiprocessing.Process:
    return next(p for p in multiprocessing.active_children() if p.name == f"spec-tp-rank-{n}")


def test_a_rank_killed_while_starting_fails_the_start(target):
    def kill_rank_1():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(_rank(1).pid, signal.SIGKILL)
                return
            except StopIteration:
                time.sleep(0.01)

    killer = threading.Thread(target=kill_rank_1)
    killer.start()
    start = time.monotonic()
    with pytest.raises(DistributedError, match="could not start: rank 1 was killed by signal SIGKILL"):
        engine(target, tp=2)
    killer.join()
    assert time.monotonic() - start < 30


def test_a_rank_that_dies_ends_generation_with_an_error(target):
    eng = engine(target, tp=2)
    assert eng.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 2})["output_ids"]
    os.kill(_rank(1).pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(DistributedError, match="rank 1 was killed by signal SIGKILL"):
        eng.generate(input_ids=prompts(), sampling_params=GREEDY)
    assert time.monotonic() - start < 10
    eng.shutdown()
