"""Speculative decoding is lossless, for every algorithm.

- Greedy: output identical token for token to plain decoding (fp32), batch 1 and a mixed batch, radix
  cache on and off, chunked prefill, and a spread of tree shapes.
- Sampling: on a target with an 8-token vocabulary, the empirical distribution of two-token
  continuations under each algorithm matches the exact target distribution (chi-square, p > 0.001),
  with top-k / top-p too.
"""

from __future__ import annotations

import pytest
import torch

from engine import Engine
from engine.core.sampling_params import SamplingParams
from tests.drafts import ALGOS, draft_setup, module_for
from tests.lossless import (GREEDY, SAMPLE_PROMPT, SAMPLES, VOCAB, chi_square_p, exact_two_token_distribution, prompts,
                            spec_engine)
from tests.planning import untimed
from tests.tiny import make_deepseek, make_model

# (steps, topk, draft tokens): chains, small trees, wide ones past steps*topk + 1 (SGLang's guide's
# (3, 4, 16) and (5, 8, 64): EAGLE-2 ranks topk + (steps-1)*topk^2 candidates), a deep one.
SHAPES = [(1, 1, 2), (3, 1, 4), (7, 1, 8), (2, 2, 4), (3, 4, 8), (3, 4, 16), (5, 8, 32), (5, 8, 64), (8, 8, 64)]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("target"), "llama", seed=3)


@pytest.fixture(scope="module")
def plain_outputs(target):
    eng = Engine(planner=untimed, model_path=str(target), dtype="float32", max_total_tokens=8192)
    return [o["output_ids"] for o in eng.generate(input_ids=prompts(), sampling_params=GREEDY)]


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_greedy_identical_batched(algo, shape, target, tmp_path, plain_outputs):
    eng = spec_engine(algo, target, tmp_path, shape)
    outs = eng.generate(input_ids=prompts(), sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == plain_outputs
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)


def _triton() -> bool:
    from spec_kernels.paged_attention import available

    return available()


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("variant", [
    {"disable_radix_cache": True}, {"chunked_prefill_size": 8}, {"max_running_requests": 1},
    {"max_total_tokens": 75}, {"max_total_tokens": 160, "max_running_requests": 2, "disable_radix_cache": True},
    {"speculative_attention_mode": "decode"}],
    ids=["radix-off", "chunked", "batch-1", "preempt", "waves-through-the-pool", "tree-as-decode-rows"])
def test_greedy_identical_under_scheduling_variants(algo, variant, target, tmp_path, plain_outputs):
    eng = spec_engine(algo, target, tmp_path, (3, 2, 6), **variant)
    outs = eng.generate(input_ids=prompts(), sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == plain_outputs
    if variant.get("max_total_tokens") == 75:
        assert eng.stats()["retractions"] > 0


@pytest.mark.skipif(not _triton(), reason="no triton")
@pytest.mark.parametrize("algo", [a if a == "NGRAM" else pytest.param(a, marks=pytest.mark.slow) for a in ALGOS])
def test_greedy_identical_through_the_triton_kernels(algo, target, tmp_path, plain_outputs):
    """The GPU's attention kernels, run by Triton's interpreter on the CPU (a minute an algorithm: NGRAM's
    tree by default, every algorithm under -m slow and on a GPU in benchmarks/gpu_check.sh)."""
    eng = spec_engine(algo, target, tmp_path, (3, 2, 6), attention_backend="triton")
    outs = eng.generate(input_ids=prompts(), sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == plain_outputs


@pytest.mark.parametrize("algo", ALGOS)
def test_stop_inside_accepted_run_is_not_passed(algo, target, tmp_path, plain_outputs):
    eng = spec_engine(algo, target, tmp_path, (5, 1, 6))
    p, ref = prompts()[-1], plain_outputs[-1]
    for cut in (1, 4, 9):
        out = eng.generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": cut})
        assert out["output_ids"] == ref[:cut]
        stop = ref[cut]
        out = eng.generate(input_ids=p, sampling_params={**GREEDY, "stop_token_ids": [stop]})
        assert out["output_ids"] == ref[:ref.index(stop) + 1]


# ---------------------------------------------------------------------------------------- DeepSeek-V3
@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """A tiny DeepSeek-V3 target (MLA, MoE) with its nextn layer (MLA, MoE too), SGLang's export of that
    layer as a separate checkpoint, and the target's plain greedy outputs."""
    from tests import eagle_checkpoints as eagle

    root = tmp_path_factory.mktemp("deepseek")
    target = eagle.save_mtp_target(root / "mtp", make_deepseek(root / "base", seed=3), "nextn")
    export = eagle.save_nextn_export(root / "export", target)
    plain = Engine(planner=untimed, model_path=str(target), dtype="float32", max_total_tokens=8192)
    return target, export, [o["output_ids"] for o in plain.generate(input_ids=prompts(), sampling_params=GREEDY)]


@pytest.mark.parametrize("algo, shape, variant", [
    ("MTP", (1, 1, 2), {}), ("MTP", (3, 1, 4), {}), ("MTP", (3, 4, 16), {}), ("MTP", (5, 8, 64), {}),
    ("EAGLE", (3, 2, 6), {}),                         # no draft: the target's nextn layer, as SGLang runs it
    ("NEXTN", (3, 2, 6), {"export": True}),           # SGLang's exported nextn checkpoint as the draft
    ("MTP", (3, 2, 6), {"chunked_prefill_size": 8}), ("MTP", (3, 2, 6), {"max_total_tokens": 75}),
], ids=["chain-1", "chain-3", "3x4x16", "5x8x64", "eagle-form", "export", "chunked", "preempt"])
def test_deepseek_nextn_draft_greedy_identical(deepseek, algo, shape, variant):
    target, export, plain = deepseek
    kw = {"max_total_tokens": 8192, **variant}
    if kw.pop("export", False):
        kw["speculative_draft_model_path"] = str(export)
    steps, topk, tokens = shape
    eng = Engine(planner=untimed, model_path=str(target), dtype="float32", speculative_algorithm=algo,
                 speculative_adaptive="off", speculative_num_steps=steps,
                 speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens, **kw)
    assert eng.args.speculative_algorithm == "MTP"
    outs = eng.generate(input_ids=prompts(), sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == plain
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)
    if kw["max_total_tokens"] < 100:
        assert eng.stats()["retractions"] > 0


# ---------------------------------------------------------------------------------------- sampling
@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("small"), "llama", seed=5, vocab=VOCAB)


def _sampled_pairs(eng: Engine, sampling: dict, seeded: bool) -> torch.Tensor:
    """Counts of the first two output tokens over SAMPLES requests of one prompt."""
    params = {**sampling, "max_new_tokens": 2, "ignore_eos": True}
    outs = eng.generate(input_ids=[SAMPLE_PROMPT] * SAMPLES,
                        sampling_params=[{**params, "seed": 1000 + i} if seeded else params for i in range(SAMPLES)])
    counts = torch.zeros(VOCAB, VOCAB)
    for o in outs:
        a, b = o["output_ids"]
        counts[a, b] += 1
    return counts


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 3, "top_p": 0.9}],
                         ids=["plain", "topk-topp"])
@pytest.mark.parametrize("shape", [(3, 1, 4), (2, 3, 6)], ids=["chain", "tree"])
def test_sampling_matches_target_distribution(algo, sampling, shape, small_target, tmp_path):
    """Seeded requests (the coupled rule): the output is the target's distribution, and each request's
    tokens are plain decoding's for its seed."""
    pytest.importorskip(module_for(algo))
    steps, topk, tokens = shape
    kw = {"model_path": str(small_target), **draft_setup(algo, small_target, tmp_path, vocab=VOCAB)}
    eng = Engine(planner=untimed,
                 dtype="float32", max_total_tokens=32768, max_running_requests=256, speculative_algorithm=algo,
                 speculative_adaptive="off",
                 speculative_num_steps=steps, speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens, **kw)
    counts = _sampled_pairs(eng, sampling, seeded=True)
    expected = exact_two_token_distribution(small_target, SAMPLE_PROMPT, SamplingParams(**sampling))
    assert chi_square_p(counts, expected) > 0.001
    assert eng.stats()["avg_spec_accept_length"] > 1.1, "drafts were accepted: the test exercised verification"
    plain = Engine(planner=untimed,
                   model_path=kw["model_path"], dtype="float32", max_total_tokens=32768, max_running_requests=256)
    assert torch.equal(_sampled_pairs(plain, sampling, seeded=True), counts)


@pytest.mark.parametrize("algo, rule", [("NGRAM", "tree"), ("STANDALONE", "tree"), ("STANDALONE", "rejection")])
def test_unseeded_rules_match_target_distribution(algo, rule, small_target, tmp_path):
    """Requests without a seed under --speculative-sampling tree or rejection: still the target's
    distribution (their draws depend on the drafts, so only the distribution is compared)."""
    kw = {"model_path": str(small_target), **draft_setup(algo, small_target, tmp_path, vocab=VOCAB)}
    eng = Engine(planner=untimed,
                 dtype="float32", max_total_tokens=32768, max_running_requests=256, speculative_algorithm=algo,
                 speculative_adaptive="off",
                 speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                 speculative_sampling=rule, **kw)
    sampling = {"temperature": 0.8, "top_k": 3, "top_p": 0.9}
    counts = _sampled_pairs(eng, sampling, seeded=False)
    expected = exact_two_token_distribution(small_target, SAMPLE_PROMPT, SamplingParams(**sampling))
    assert chi_square_p(counts, expected) > 0.001
    assert eng.stats()["avg_spec_accept_length"] > 1.1


# ---------------------------------------------------------------------------------------- multi-layer MTP
@pytest.fixture(scope="module")
def multi_mtp(tmp_path_factory):
    """Per layout: a tiny target with 3 random MTP layers, as MiMo-V2 carries them (mimo, on a Qwen2) and as
    DeepSeek-style nextn layers after the decoder layers (nextn, on a Llama), and its plain greedy outputs."""
    from tests import eagle_checkpoints as eagle

    root, out = tmp_path_factory.mktemp("multi_mtp"), {}
    for layout, arch in (("mimo", "qwen2"), ("nextn", "llama")):
        base = make_model(root / arch, arch, seed=3)
        plain = Engine(planner=untimed, model_path=str(base), dtype="float32", max_total_tokens=8192)
        out[layout] = (eagle.save_mtp_target(root / layout, base, layout, seed=7, exact=(False,) * 3),
                       [o["output_ids"] for o in plain.generate(input_ids=prompts(), sampling_params=GREEDY)])
    return out


@pytest.mark.parametrize("layout", ["mimo", "nextn"])
@pytest.mark.parametrize("shape, variant", [
    ((3, 1, 4), {}), ((2, 1, 3), {"enable_multi_layer_eagle": True}), ((3, 1, 4), {"chunked_prefill_size": 8}),
    ((3, 1, 4), {"max_total_tokens": 75}), ((3, 1, 4), {"disable_radix_cache": True}),
], ids=["auto", "flag-2-of-3", "chunked", "preempt", "no-radix"])
def test_multi_layer_mtp_greedy_identical(multi_mtp, layout, shape, variant):
    """Draft step k runs MTP layer k (3 layers: on by itself); decoding stays the target's (fp32) under
    scheduling variants and over radix-shared prefixes (the second call repeats the prompts)."""
    target, plain = multi_mtp[layout]
    steps, topk, tokens = shape
    eng = Engine(planner=untimed, model_path=str(target), dtype="float32", speculative_algorithm="MTP",
                 speculative_adaptive="off", speculative_num_steps=steps,
                 speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens,
                 **{"max_total_tokens": 8192, **variant})
    assert eng.args.enable_multi_layer_eagle
    for _ in range(2):
        outs = eng.generate(input_ids=prompts(), sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == plain
    if variant.get("max_total_tokens"):
        assert eng.stats()["retractions"] > 0
