"""The engine against ground truth: transformers' logits and greedy decoding, and itself under batching,
radix sharing, chunked prefill and preemption."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import Engine, ModelLoadError, RequestError
from engine.core.forward_batch import make_batch
from tests.greedy import GREEDY, prompts
from tests.planning import untimed
from tests.tiny import make_model, reference_greedy, tiny_runner


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("llama"), "llama")


def engine(model_dir, **kw) -> Engine:
    return Engine(model_path=str(model_dir), dtype=kw.pop("dtype", "float32"),
                  max_total_tokens=kw.pop("max_total_tokens", 4096), planner=untimed, **kw)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_logits_match_transformers(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    model_dir = make_model(tmp_path, arch, tie=arch == "qwen2")
    runner, kv = tiny_runner(model_dir)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    a, b = prompts(2, seed=1)
    batch = make_batch(kv.table, [0, 1], [0, 0], a + b, kv.alloc(len(a) + len(b)), [len(a), len(b)],
                       capture_hidden=(1,))
    out = runner.forward(batch, all_logits=True)
    with torch.no_grad():
        ref_a = ref(torch.tensor([a]), output_hidden_states=True)
        ref_b = ref(torch.tensor([b])).logits[0]
    torch.testing.assert_close(out.logits[:len(a)], ref_a.logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits[len(a):], ref_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.captured[1][:len(a)], ref_a.hidden_states[1][0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_transformers(tmp_path, arch):
    model_dir = make_model(tmp_path, arch)
    eng = engine(model_dir)
    for p in prompts(3, seed=2):
        got = eng.generate(input_ids=p, sampling_params=GREEDY)["output_ids"]
        assert got == reference_greedy(model_dir, p, GREEDY["max_new_tokens"])


def test_batch_equals_one_by_one(llama_dir):
    ps = prompts(6, seed=3)
    eng = engine(llama_dir)
    batched = [o["output_ids"] for o in eng.generate(input_ids=ps, sampling_params=GREEDY)]
    single = [engine(llama_dir, disable_radix_cache=True).generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in ps]
    assert batched == single


def test_deterministic_inference_gives_bf16_outputs_alone_equal_to_batched_and_chunked(llama_dir):
    """--enable-deterministic-inference: prompts batched together, prefilled in chunks of 7 and partly
    cached, produce the hidden states, hence the tokens, of each prompt run alone in one piece."""
    ps = prompts(6, seed=12, lo=20, hi=40)
    batched_eng = engine(llama_dir, dtype="bfloat16", enable_deterministic_inference=True, chunked_prefill_size=7)
    batched_eng.generate(input_ids=ps[0][:15], sampling_params=GREEDY)     # a cached prefix for the first
    batched = batched_eng.generate(input_ids=ps, sampling_params=GREEDY, return_logprob=True)
    alone_eng = engine(llama_dir, dtype="bfloat16", enable_deterministic_inference=True, disable_radix_cache=True)
    for p, b in zip(ps, batched):
        a = alone_eng.generate(input_ids=p, sampling_params=GREEDY, return_logprob=True)
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]


@pytest.mark.parametrize("flags", [{"attention_backend": "triton"}, {"device": "cuda"}])
def test_deterministic_inference_is_refused_where_it_cannot_act(flags):
    from engine.attention import check_deterministic
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="enable-deterministic-inference"):
        check_deterministic(flags.get("attention_backend", "torch"), flags.get("device", "cpu"))


@pytest.mark.parametrize("flags,needle", [({"attention_backend": "flashinfer"}, "flashinfer"),
                                          ({"attention_backend": "triton", "enable_deterministic_inference": True},
                                           "deterministic")])
def test_backend_flags_are_refused_before_the_model_is_read(flags, needle, tmp_path):
    """The model path does not exist: the refusal comes first, before any file is read or converted."""
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match=needle):
        Engine(model_path=str(tmp_path / "no-such-model"), **flags)


def test_radix_hit_gives_same_output(llama_dir):
    base = prompts(1, seed=4, lo=30, hi=31)[0]
    follow = base + [7, 8, 9]
    eng = engine(llama_dir)
    first = eng.generate(input_ids=base, sampling_params=GREEDY)
    second = eng.generate(input_ids=follow, sampling_params=GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    # A cached position is reused when the token after it agrees too (radix pair keys): base's last
    # position was followed by the first output token, not 7.
    assert second["meta_info"]["cached_tokens"] >= len(base) - 1
    fresh = engine(llama_dir, disable_radix_cache=True).generate(input_ids=follow, sampling_params=GREEDY)
    assert second["output_ids"] == fresh["output_ids"]


def test_chunked_prefill_same_output(llama_dir):
    p = prompts(1, seed=5, lo=60, hi=61)[0]
    plain = engine(llama_dir, chunked_prefill_size=0).generate(input_ids=p, sampling_params=GREEDY)
    chunked_eng = engine(llama_dir, chunked_prefill_size=7)
    chunked = chunked_eng.generate(input_ids=p, sampling_params=GREEDY)
    assert chunked["output_ids"] == plain["output_ids"]
    assert chunked_eng.stats()["prefill_tokens"] == len(p)


@pytest.mark.parametrize("radix", [True, False])
def test_preemption_under_tiny_kv_budget(llama_dir, radix):
    ps = prompts(6, seed=6, lo=10, hi=20)
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    ref = [o["output_ids"] for o in engine(llama_dir).generate(input_ids=ps, sampling_params=params)]
    small = engine(llama_dir, max_total_tokens=120, disable_radix_cache=not radix)
    got = small.generate(input_ids=ps, sampling_params=params)
    assert [o["output_ids"] for o in got] == ref
    stats = small.stats()
    assert stats["retractions"] > 0
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in got)
    # Every slot is back: in the free list or (radix on) in the prefix cache, none leaked.
    assert stats["kv_tokens_used"] == 0 and stats["kv_tokens_total"] == 120
    assert (stats["kv_tokens_cached"] > 0) == radix


@pytest.mark.parametrize("radix", [True, False])
def test_requests_in_waves_through_a_small_pool(llama_dir, radix):
    """More requests than run at once, in a pool they cycle through several times: each answer is the
    one it gets alone. (Freed slots once stayed views of the request table: the rows' next requests
    rewrote them, two requests got the same slots and read each other's KV once the pool wrapped.)"""
    ps = prompts(12, seed=11, lo=10, hi=30)
    params = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}
    alone = [engine(llama_dir).generate(input_ids=p, sampling_params=params)["output_ids"] for p in ps]
    small = engine(llama_dir, max_total_tokens=160, max_running_requests=3, disable_radix_cache=not radix)
    assert [o["output_ids"] for o in small.generate(input_ids=ps, sampling_params=params)] == alone


def test_what_cannot_fit_the_pool_is_known_at_admission(llama_dir):
    """A prompt the KV pool cannot hold is refused at once; max_new_tokens beyond what fits is clamped
    and the answer ends with "length" (not after minutes, not an abort)."""
    eng = engine(llama_dir, max_total_tokens=30)
    with pytest.raises(RequestError, match="KV pool holds 30: raise --max-total-tokens to 65"):
        eng.generate(input_ids=prompts(1, seed=7, lo=40, hi=41)[0], sampling_params=GREEDY)
    out = eng.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 100})
    assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 30 - 1 - 3


def test_seeded_sampling_reproducible(llama_dir):
    p = prompts(1, seed=8)[0]
    params = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 24, "seed": 1234, "ignore_eos": True}
    a = engine(llama_dir).generate(input_ids=p, sampling_params=params)["output_ids"]
    eng = engine(llama_dir)
    # Same seed in a batch with other requests, and under preemption: still the same tokens.
    batch = eng.generate(input_ids=[p] + prompts(3, seed=9), sampling_params=[params] + [GREEDY] * 3)
    assert batch[0]["output_ids"] == a
    other = engine(llama_dir).generate(input_ids=p, sampling_params={**params, "seed": 99})["output_ids"]
    assert other != a


def test_stop_conditions(llama_dir):
    eng = engine(llama_dir)
    p = prompts(1, seed=10)[0]
    full = eng.generate(input_ids=p, sampling_params=GREEDY)
    ids = full["output_ids"]
    # A stop token id fires at its first occurrence, the token kept in output_ids.
    stop_tok = ids[5]
    out = eng.generate(input_ids=p, sampling_params={**GREEDY, "stop_token_ids": [stop_tok]})
    assert out["output_ids"] == ids[:ids.index(stop_tok) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    # A stop string is cut from the text; nothing after it is emitted.
    text = full["text"]
    needle = text[len(text) // 2: len(text) // 2 + 3]
    if needle.strip():
        out = eng.generate(input_ids=p, sampling_params={**GREEDY, "stop": [needle]})
        assert out["text"] == text[:text.index(needle)]
        assert out["meta_info"]["finish_reason"]["matched"] == needle
    out = eng.generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 5})
    assert out["output_ids"] == ids[:5] and out["meta_info"]["finish_reason"]["type"] == "length"


def test_eos_stops_unless_ignored(llama_dir, tmp_path):
    p = prompts(1, seed=11)[0]
    ids = engine(llama_dir).generate(input_ids=p, sampling_params=GREEDY)["output_ids"]
    # The same model, whose generation_config.json lists the 4th token as an EOS beside its own.
    shutil.copytree(llama_dir, tmp_path / "eos", dirs_exist_ok=True)
    config = tmp_path / "eos" / "generation_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "eos_token_id": [1, ids[3]]}))
    eng = engine(tmp_path / "eos")
    assert eng.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] == ids
    out = eng.generate(input_ids=p, sampling_params={**GREEDY, "ignore_eos": False})
    assert out["output_ids"] == ids[:ids.index(ids[3]) + 1]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_streaming_yields_growing_text_and_matches(llama_dir):
    eng = engine(llama_dir)
    p = "The quick brown fox"
    final = eng.generate(p, GREEDY)
    chunks = list(eng.generate(p, GREEDY, stream=True))
    assert len(chunks) > 1
    assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:]))
    assert chunks[-1]["text"] == final["text"] and chunks[-1]["output_ids"] == final["output_ids"]


@pytest.mark.parametrize("params, message", [
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_k": -3}, "top_k"),
    ({"bogus": 1}, "Unknown sampling parameter"),
])
def test_bad_sampling_params(llama_dir, params, message):
    eng = engine(llama_dir)
    with pytest.raises(RequestError, match=message):
        eng.generate("hello", params)


def test_prompt_longer_than_context(llama_dir):
    eng = engine(llama_dir, context_length=32)
    with pytest.raises(RequestError, match="context length is 32"):
        eng.generate(input_ids=list(range(3, 40)), sampling_params=GREEDY)
    with pytest.raises(RequestError, match="token ids"):
        eng.generate(input_ids=[5, 100000], sampling_params=GREEDY)


def test_missing_model_and_unsupported_arch(tmp_path):
    with pytest.raises(ModelLoadError, match="does-not-exist"):
        Engine(model_path=str(tmp_path / "does-not-exist"))
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(tmp_path / "gpt2")
    from tests.tiny import make_tokenizer

    make_tokenizer(tmp_path / "gpt2")
    with pytest.raises(ModelLoadError, match="not supported"):
        Engine(model_path=str(tmp_path / "gpt2"))


@pytest.mark.parametrize("rope", [{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}])
def test_rope_scaled_models_build_on_any_device(rope):
    """Rotary tables are computed on the CPU and placed where the model is built: on the meta device
    (as on a GPU) nothing mixes devices."""
    import transformers

    from engine.models.llama import LlamaForCausalLM

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=320, max_position_embeddings=512,
                                      rope_scaling=rope)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions=512)
    assert model.model.rotary.cos.device.type == "meta"
    cpu = LlamaForCausalLM(config, max_positions=512).model.rotary
    assert cpu.cos.shape == (512, 16) and torch.isfinite(cpu.cos).all()


def test_memory_budget_counts_the_draft(llama_dir, tmp_path):
    """--mem-fraction-static covers weights and KV of the target and the draft: with a draft (here the
    target itself, twice the KV per token) the pool holds about half the tokens."""
    alone = engine(llama_dir, max_total_tokens=None, mem_fraction_static=0.001)
    with_draft = engine(llama_dir, max_total_tokens=None, mem_fraction_static=0.001,
                        speculative_algorithm="STANDALONE", speculative_draft_model_path=str(llama_dir))
    assert 0.45 < with_draft.kv_capacity / alone.kv_capacity < 0.5
