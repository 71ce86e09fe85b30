"""Lossless on real models (slow: needs the fetched GGUFs): NGRAM's greedy output on SmolLM2-135M is plain
decoding's token for token, four requests batched, over two turns (the second reusing the first's
cached KV), in dense float32 and with the CPU's quantized weights (the default: w4a8 on a CPU with
VNNI, else int4 with bf16 activations where the CPU has them; and int4, w8a8_int8 named); and so is
STANDALONE's (0.5B draft) on Qwen2.5-Coder-1.5B with the default weights, whose Q6_K layers and head
the w4a8 kernel serves as stored. That holds only because decode steps attend through the
batch-invariant kernel (kernels/cpu_attention.c) and the radix cache keeps the same positions in both
modes: with bf16 or int8 activations, any last-bit difference between a verify and a decode forward
grows into a different token (14 of 16 MT-Bench answers differed before)."""

from __future__ import annotations

import pytest

from engine import Engine
from engine.loader import KNOWN_MODELS, models_dir

PROMPTS = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "Explain, step by step, how to compute the greatest common divisor of 1071 and 462.",
           "List the planets of the solar system with one fact about each.",
           "Write a Python function that checks whether a string is a palindrome, with tests."]
FOLLOW_UP = "Now say it again in half as many words."
GREEDY = {"temperature": 0, "max_new_tokens": 96, "ignore_eos": True}


def two_turns(eng: Engine) -> list[list[int]]:
    def encode(messages):
        text = eng.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return eng.tokenizer(text, add_special_tokens=False).input_ids

    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    first = eng.generate(input_ids=[encode(c) for c in chats], sampling_params=GREEDY)
    for chat, out in zip(chats, first):
        chat += [{"role": "assistant", "content": out["text"]}, {"role": "user", "content": FOLLOW_UP}]
    second = eng.generate(input_ids=[encode(c) for c in chats], sampling_params=GREEDY)
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in second)
    return [o["output_ids"] for o in first + second]


@pytest.mark.slow
@pytest.mark.parametrize("weights", [{"dtype": "float32"}, {}, {"quantization": "int4"},
                                     {"quantization": "w8a8_int8"}],
                         ids=["float32", "cpu-default", "int4", "w8a8_int8"])
def test_ngram_greedy_equals_plain_on_smollm2(weights):
    path = models_dir() / "smollm2-135m" / KNOWN_MODELS["smollm2-135m"].filename
    if not path.is_file():
        pytest.skip(f"{path} not fetched (spec fetch smollm2-135m)")
    outputs = {}
    for algo in (None, "NGRAM"):
        with Engine(model_path=str(path), max_total_tokens=8192, speculative_algorithm=algo, **weights) as eng:
            outputs[algo] = two_turns(eng)
            if algo:
                assert eng.stats()["avg_spec_accept_length"] > 1
    assert outputs["NGRAM"] == outputs[None]


@pytest.mark.slow
def test_standalone_greedy_equals_plain_on_qwen():
    target, draft = (models_dir() / name / KNOWN_MODELS[name].filename
                     for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"))
    if not (target.is_file() and draft.is_file()):
        pytest.skip("Qwen2.5-Coder GGUFs not fetched (spec fetch qwen2.5-coder-0.5b qwen2.5-coder-1.5b)")
    outputs = {}
    for algo in (None, "STANDALONE"):
        spec = {"speculative_algorithm": algo, "speculative_draft_model_path": str(draft)} if algo else {}
        with Engine(model_path=str(target), max_total_tokens=8192, **spec) as eng:
            outputs[algo] = two_turns(eng)
            if algo:
                assert eng.stats()["avg_spec_accept_length"] > 1
    assert outputs["STANDALONE"] == outputs[None]
