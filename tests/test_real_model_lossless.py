"""Lossless on a real model (slow: needs the fetched SmolLM2-135M GGUF): in dense float32, NGRAM's
greedy output is plain decoding's token for token. With quantized weights it is not on real models
(docs/speculative.md, "Why the output is unchanged"), so this guards the float32 property only."""

from __future__ import annotations

import pytest

from engine import Engine
from engine.loader import KNOWN_MODELS, models_dir

PROMPTS = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "Explain, step by step, how to compute the greatest common divisor of 1071 and 462.",
           "List the planets of the solar system with one fact about each.",
           "Write a Python function that checks whether a string is a palindrome, with tests."]
GREEDY = {"temperature": 0, "max_new_tokens": 96, "ignore_eos": True}


@pytest.mark.slow
def test_ngram_greedy_equals_plain_on_smollm2_in_float32():
    path = models_dir() / "smollm2-135m" / KNOWN_MODELS["smollm2-135m"].filename
    if not path.is_file():
        pytest.skip(f"{path} not fetched (spec fetch smollm2-135m)")
    outputs = {}
    for algo in (None, "NGRAM"):
        with Engine(model_path=str(path), dtype="float32", max_total_tokens=8192, speculative_algorithm=algo) as eng:
            texts = [eng.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                       tokenize=False) for p in PROMPTS]
            chats = [eng.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
            outputs[algo] = [o["output_ids"] for o in eng.generate(input_ids=chats, sampling_params=GREEDY)]
            if algo:
                assert eng.stats()["avg_spec_accept_length"] > 1
    assert outputs["NGRAM"] == outputs[None]
