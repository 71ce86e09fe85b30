"""Out of memory, made actionable: at start-up, for a request larger than the pool, and when decode has to
retract requests, the message names the flag to turn and a value that would fit; those values do fit."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from engine import ConfigError, Engine, RequestError
from engine.memory.budget import KVBudget
from tests.planning import untimed
from tests.tiny import make_model

GiB = 2**30
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("llama"), "llama")


def engine(model_dir, **kw) -> Engine:
    return Engine(planner=untimed, model_path=str(model_dir), dtype="float32", **kw)


def flag_value(message: str, flag: str) -> float:
    return float(re.search(rf"{flag} ([0-9.]+)", message).group(1))


# ------------------------------------------------------------------ start-up
def test_weights_leaving_no_room_name_the_fraction_that_fits():
    # 8 GiB, 2.38 GiB of weights, 1 MiB per KV token: 0.3 leaves 20 MiB; 4096 tokens need 0.80.
    weights = int(2.38 * GiB)
    with pytest.raises(ConfigError) as err:
        KVBudget.plan(None, 0.3, 8 * GiB, weights, 2**20, wanted=4096)
    message = str(err.value)
    assert "leaving no KV cache within --mem-fraction-static 0.3" in message
    assert flag_value(message, "--mem-fraction-static to") == 0.8 and "--max-total-tokens 4096" in message
    assert KVBudget.plan(None, 0.8, 8 * GiB, weights, 2**20, wanted=4096).slots >= 4096


def test_a_device_too_small_for_the_context_says_what_to_lower():
    with pytest.raises(ConfigError, match=r"even --mem-fraction-static 0.95 holds only 1126 KV tokens.*"
                                          r"lower --context-length to 1062"):
        KVBudget.plan(None, 0.3, 8 * GiB, int(6.5 * GiB), 2**20, wanted=32768)


def test_a_pool_short_of_one_full_request_is_a_warning_with_the_fix(llama_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="engine.memory.budget"):
        engine(llama_dir, max_total_tokens=200)
    assert "fewer than one request of --context-length 512 needs (513)" in caplog.text
    assert "raise --max-total-tokens to 513" in caplog.text and "lower --context-length to 199" in caplog.text


def test_pool_allocation_failure_names_a_size_that_fits(llama_dir, monkeypatch):
    from engine.memory.kv_pool import KVPool

    class OutOfMemory(KVPool):
        def __init__(self, *args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr("engine.build.KVPool", OutOfMemory)
    with pytest.raises(ConfigError, match=r"Allocating the KV pool of \d+ tokens .* ran out of memory with .* free: "
                                          r"lower --mem-fraction-static to .* or pass --max-total-tokens \d+"):
        engine(llama_dir, mem_fraction_static=0.01)


# ------------------------------------------------------------------ under load
@pytest.mark.parametrize("spec", [{}, {"speculative_algorithm": "NGRAM", "speculative_num_steps": 3,
                                       "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6}],
                         ids=["plain", "ngram"])
def test_request_larger_than_the_pool_names_the_size_that_serves_it(llama_dir, spec):
    """Refused at admission, naming the pool size that serves it whole."""
    prompt = list(range(3, 43))
    with pytest.raises(RequestError, match="cannot be served") as refused:
        engine(llama_dir, max_total_tokens=30, **spec).generate(input_ids=prompt, sampling_params=GREEDY)
    message = str(refused.value)
    assert ("--speculative-num-draft-tokens" in message) == bool(spec)
    tokens = int(flag_value(message, "--max-total-tokens to"))
    served = engine(llama_dir, max_total_tokens=tokens, **spec).generate(input_ids=prompt, sampling_params=GREEDY)
    assert served["meta_info"]["finish_reason"]["type"] == "length"


def test_retractions_name_values_that_avoid_them(llama_dir, caplog):
    prompts = [list(range(3 + i, 23 + i)) for i in range(6)]          # 6 requests of 20 + 24 tokens
    with caplog.at_level(logging.WARNING, logger="engine.memory.budget"):
        eng = engine(llama_dir, max_total_tokens=150)
        eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert eng.stats()["retractions"] > 0
    [warning] = [r.getMessage() for r in caplog.records if "KV cache full" in r.getMessage()]   # once a minute
    running = int(flag_value(warning, "--max-running-requests"))
    tokens = int(flag_value(warning, "--max-total-tokens to"))
    for kw in ({"max_total_tokens": 150, "max_running_requests": running}, {"max_total_tokens": tokens}):
        again = engine(llama_dir, **kw)
        again.generate(input_ids=prompts, sampling_params=GREEDY)
        assert again.stats()["retractions"] == 0, kw
