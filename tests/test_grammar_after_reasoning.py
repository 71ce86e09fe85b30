"""Grammars after the reasoning (SamplingParams.reasoning_end): the grammar constrains only the output
after the end sequence first appears in it, and the output stays lossless under every algorithm,
drafts that cross the boundary included.

A random model has no thinking to end, so the boundary is taken from its own unconstrained greedy
output: the tokens at some position of it become reasoning_end, and the constrained output reaches
them naturally. Up to and with them it equals the unconstrained output; after them it is the grammar's.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from engine import Engine
from engine.core.grammar import GrammarBackend, row_bitmask
from engine.core.sampling_params import SamplingParams
from engine.errors import RequestError
from tests.drafts import ALGOS, draft_setup
from tests.lossless import VOCAB, chi_square_p, prompts, spec_engine
from tests.planning import untimed
from tests.scripted import make_scripted_model
from tests.tiny import make_model, make_tokenizer, target_probs

FREE = {"temperature": 0, "max_new_tokens": 40}
SCHEMA = json.dumps({"type": "object", "properties": {"kind": {"enum": ["fox", "dog"]},
                                                      "n": {"type": "integer", "minimum": 0, "maximum": 99}},
                     "required": ["kind", "n"]})
REGEX = "[ab]{3}x"
# Per prompt: the grammar, and where in the free output its reasoning_end starts and how long it is.
CASES = [({"json_schema": SCHEMA}, 6, 1), ({"regex": REGEX}, 4, 2), ({"json_schema": SCHEMA}, 9, 3),
         ({"regex": REGEX}, 2, 1), ({"json_schema": SCHEMA}, 5, 3)]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("target"), "llama", seed=3)


@pytest.fixture(scope="module")
def plain(target):
    return Engine(planner=untimed, model_path=str(target), dtype="float32", max_total_tokens=8192,
                  constrained_json_disable_any_whitespace=True)


def end_of(output: list[int], seq) -> int:
    """Where the first occurrence of seq in output ends: the position of the grammar's first token."""
    n = len(seq)
    return next(i + n for i in range(len(output) - n + 1) if tuple(output[i:i + n]) == tuple(seq))


@pytest.fixture(scope="module")
def batch(plain):
    """(prompt, sampling params, boundary, free output) per case: reasoning_end taken from the free
    greedy output, so that the constrained output reaches it."""
    out = []
    for prompt, (grammar, at, length) in zip(prompts(), CASES):
        free = plain.generate(input_ids=prompt, sampling_params=FREE)["output_ids"]
        assert len(free) >= at + length, "the free output ended before the case's boundary"
        end = free[at:at + length]
        params = {"temperature": 0, "max_new_tokens": 100, **grammar, "reasoning_end": end}
        out.append((prompt, params, end_of(free, end), free))
    return out


def check_after(tokenizer, params: dict, output: list[int], boundary: int) -> None:
    """The output after the boundary is the grammar's, complete."""
    text = tokenizer.decode(output[boundary:], skip_special_tokens=True)
    if "regex" in params:
        assert re.fullmatch(params["regex"], text), text
    else:
        assert set(json.loads(text)) == {"kind", "n"}, text


def test_the_grammar_starts_after_the_end_sequence(plain, batch):
    outs = plain.generate(input_ids=[p for p, *_ in batch], sampling_params=[s for _, s, *_ in batch])
    for (prompt, params, boundary, free), o in zip(batch, outs):
        ids = o["output_ids"]
        assert ids[:boundary] == free[:boundary]                # the thinking is free, its end too
        assert o["meta_info"]["finish_reason"]["type"] == "stop"
        check_after(plain.tokenizer, params, ids, boundary)
    # Without reasoning_end the grammar holds from the first token: another output.
    params, boundary = batch[0][1], batch[0][2]
    whole = plain.generate(input_ids=batch[0][0], sampling_params={**params, "reasoning_end": None})["output_ids"]
    assert whole != outs[0]["output_ids"]
    check_after(plain.tokenizer, params, whole, 0)


def test_an_end_sequence_never_output_leaves_the_output_free(plain, batch):
    prompt, params, _, free = batch[0]
    absent = next(t for t in range(3, 300) if t not in free)
    got = plain.generate(input_ids=prompt, sampling_params={**params, "max_new_tokens": FREE["max_new_tokens"],
                                                            "reasoning_end": [absent]})
    assert got["output_ids"] == free


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("shape", [(3, 1, 4), (3, 3, 8)], ids=["chain", "tree"])
def test_speculative_output_is_plain_constrained_decodings(algo, shape, target, tmp_path, plain, batch):
    eng = spec_engine(algo, target, tmp_path, shape, constrained_json_disable_any_whitespace=True)
    ids, params = [p for p, *_ in batch], [s for _, s, *_ in batch]
    expected = plain.generate(input_ids=ids, sampling_params=params)
    outs = eng.generate(input_ids=ids, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in expected]
    if algo == "NGRAM":                 # drafts were accepted: verification ran under the masks
        assert sum(o["meta_info"]["spec_verify_ct"] for o in outs) < sum(len(o["output_ids"]) for o in outs)


def committed_per_step(eng: Engine, prompt: list[int], params: dict) -> tuple[list[int], list[int]]:
    """The output, and how many output tokens were committed after each step."""
    req = eng.make_request(prompt, SamplingParams.from_dict(params))
    eng.add_request(req)
    lengths = []
    while not req.finished:
        eng.step()
        lengths.append(req.num_output)
    return req.output_ids, lengths


def test_a_draft_completing_a_split_end_sequence_is_verified_under_the_grammar(plain, batch):
    """Predicted Outputs steered so that a step commits the first two tokens of a three-token end
    sequence and the next step's draft holds the third and the grammar's tokens after it: that
    step commits past the boundary, and the output is plain constrained decoding's."""
    prompt, params, boundary, _ = batch[2]
    assert len(params["reasoning_end"]) == 3 and boundary >= 10, "the prediction is followed before the edit"
    expected = plain.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    # The prediction is wrong where the end sequence's second token is due, so the step verifying it
    # stops there; it goes on with the tokens before that place again, so that the place is found
    # again right after the end sequence's second token.
    wrong = next(t for t in range(3, 300) if t not in expected)
    prediction = expected[:boundary - 2] + [wrong] + expected[boundary - 4:]
    got, lengths = committed_per_step(plain, prompt, {**params, "prediction": prediction})
    assert got == expected
    assert boundary - 1 in lengths, "a step ended between the end sequence's second and third tokens"
    after = lengths[lengths.index(boundary - 1) + 1]
    assert after > boundary, "the next step's draft crossed the boundary and its grammar tokens were accepted"


# A thinker's script (tests/scripted.py): its own answer follows the end of its thinking, and VERDICT forbids it.
THINKER = ["Let", " me", " see", "</", "think", ">", "The", " answer", " is", " 4", "."]
VERDICT = json.dumps({"type": "object", "properties": {"verdict": {"enum": ["yes", "no"]}}, "required": ["verdict"],
                      "additionalProperties": False})


@pytest.mark.parametrize("shape", [(3, 1, 4), (3, 3, 8)], ids=["chain", "tree"])
def test_ngram_drafts_past_a_learnt_answer_are_verified_under_the_grammar(shape, tmp_path):
    """NGRAM's cache holds the script's own answer after the end sequence (learnt from free requests),
    then the grammar's too (the first constrained round): drafts reach and cross the boundary, requests
    batched together, each starting at another place of the script (so the end sequence is completed by
    a draft node in some steps, by the bonus token in others), each grammar run to its end. Every output
    is plain constrained decoding's, and a step commits across the boundary."""
    model = make_scripted_model(tmp_path / "thinker", THINKER)
    reference = Engine(planner=untimed, model_path=str(model), dtype="float32", max_total_tokens=8192,
                   constrained_json_disable_any_whitespace=True)
    (let,), (me,), (see,) = (reference.tokenizer.encode(p, add_special_tokens=False) for p in THINKER[:3])
    end = reference.tokenizer.encode("</think>", add_special_tokens=False)
    assert len(end) == 3, "the end sequence is three of the script's tokens"
    # Off the script the model starts at its first token; after one of its tokens, at the next.
    starts = [[5, 6, 7], [5, 6, let], [5, let, me], [5, 6, see]]
    params = {"temperature": 0, "max_new_tokens": 40, "json_schema": VERDICT, "reasoning_end": end}
    expected = [o["output_ids"] for o in reference.generate(input_ids=starts, sampling_params=params)]
    eng = spec_engine("NGRAM", model, tmp_path, shape, constrained_json_disable_any_whitespace=True)
    free = eng.generate(input_ids=starts, sampling_params=FREE)
    assert all(end_of(o["output_ids"], end) < len(o["output_ids"]) for o in free), "the cache learnt an answer"
    for _ in range(2):
        outs = eng.generate(input_ids=starts, sampling_params=params)
        assert [o["output_ids"] for o in outs] == expected
        assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs)
    got, lengths = committed_per_step(eng, starts[0], params)
    boundary = end_of(got, end)
    assert got == expected[0]
    assert any(a < boundary < b for a, b in zip([0] + lengths, lengths)), "a step committed across the boundary"


def test_tree_rows_start_the_grammar_where_a_path_completes_the_end_sequence(tmp_path):
    """Half of a two-token end sequence committed, the rest in the draft: the node completing it gets
    the grammar's first mask and its subtree the grammar's; the nodes before and beside it are free."""
    tok = make_tokenizer(tmp_path)
    backend = GrammarBackend(tok, 320, [1])
    ids = {tok.decode([i]): i for i in range(320)}
    a, b, c, q, z = (ids[ch] for ch in "abcqz")
    req = SimpleNamespace(grammar=backend.matcher(backend.compile("regex", "ab|ac|b"), (q, z)))
    assert req.grammar.accept_token(q)                          # committed: the sequence's first token
    # root q -> z -> a -> c;  root -> q -> z;  root -> b
    tree, parents = [q, z, a, c, q, z, b], [-1, 0, 1, 2, 0, 4, 0]
    bitmask, rows = row_bitmask([req], [7], 320, [tree], [parents])
    allowed = [{t for t in range(320) if bitmask[i, t // 32] >> (t % 32) & 1} for i in range(7)]
    everything = set(range(320))
    assert allowed == [everything, {a, b}, {b, c}, {1}, everything, {a, b}, everything] and rows == list(range(7))
    # No path completes it: nothing is constrained.
    assert row_bitmask([req], [3], 320, [[q, a, b]], [[-1, 0, 1]]) is None
    assert row_bitmask([req], [1], 320) is None
    # The walk left the committed state as it was: z now starts the grammar, a then b complete it.
    assert req.grammar.accept_token(z) and not req.grammar.accept_token(c)


def test_the_end_sequence_is_found_where_its_start_repeats(tmp_path):
    """(a, a, b) after a, a, a, b: the third a keeps two matched, and b completes it; the tokens after
    the boundary are the grammar's, the sequence's own included."""
    tok = make_tokenizer(tmp_path)
    backend = GrammarBackend(tok, 320, [1])
    ids = {tok.decode([i]): i for i in range(320)}
    a, b, x = ids["a"], ids["b"], ids["x"]
    grammar = backend.matcher(backend.compile("regex", "x+"), (a, a, b))
    req = SimpleNamespace(grammar=grammar)
    for t in (a, a, a):
        assert grammar.accept_token(t) and row_bitmask([req], [1], 320) is None
    assert grammar.accept_token(b)
    bitmask, rows = row_bitmask([req], [1], 320)
    assert rows == [0] and {t for t in range(320) if bitmask[0, t // 32] >> (t % 32) & 1} == {x}
    assert not grammar.fork().accept_token(a) and grammar.accept_token(x)


def test_reasoning_end_is_validated(plain):
    assert SamplingParams.from_dict({"regex": "a", "reasoning_end": [5, 6]}).reasoning_end == (5, 6)
    for bad in ([], [-1], "5", [True], [1.0], list(range(33)), 5):
        with pytest.raises(RequestError, match="reasoning_end must be a list of 1 to 32 token ids") as err:
            SamplingParams.from_dict({"regex": "a", "reasoning_end": bad})
        assert err.value.param == "reasoning_end"
    with pytest.raises(RequestError, match="pass it with one of json_schema") as err:
        SamplingParams.from_dict({"reasoning_end": [5]})
    assert err.value.param == "reasoning_end"
    with pytest.raises(RequestError, match="reasoning_end names token 320, outside the vocabulary") as err:
        plain.generate(input_ids=[5, 6], sampling_params={"regex": "a", "reasoning_end": [5, 320]})
    assert err.value.param == "reasoning_end"


# ---------------------------------------------------------------------------------------- sampling
SAMPLES = 2000
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
SAMPLED = {"temperature": 0.6}             # peaked enough that the likeliest pair is often sampled
# Tokens 3..7 of the tiny tokenizer are the characters ! " # $ %: after the boundary only ! or ".
AFTER, ALLOWED = '[!"]+', [3, 4]


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("small"), "llama", seed=5, vocab=VOCAB)


def three_token_distribution(model_dir, end: tuple[int, int], eos_ids) -> torch.Tensor:
    """P(x1, x2, x3 | PROMPT) under the target, x3 masked to ALLOWED where (x1, x2) is the end sequence;
    an output that stopped early (an EOS before the boundary) has VOCAB in the places it did not reach."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = SamplingParams(**SAMPLED)

    def probs(output, allowed=None):
        logits = model(torch.tensor([PROMPT + output])).logits[0, -1:]
        if allowed is not None:
            masked = torch.full_like(logits, float("-inf"))
            masked[:, allowed] = logits[:, allowed]
            logits = masked
        return target_probs(logits, params, PROMPT, output)[0]

    joint = torch.zeros(VOCAB + 1, VOCAB + 1, VOCAB + 1)
    with torch.no_grad():
        first = probs([])
        for x1 in range(VOCAB):
            if x1 in eos_ids:
                joint[x1, VOCAB, VOCAB] = first[x1]
                continue
            second = probs([x1])
            for x2 in range(VOCAB):
                if x2 in eos_ids:
                    joint[x1, x2, VOCAB] = first[x1] * second[x2]
                else:
                    third = probs([x1, x2], ALLOWED if (x1, x2) == end else None)
                    joint[x1, x2, :VOCAB] = first[x1] * second[x2] * third
    return joint


@pytest.fixture(scope="module")
def sampled(small_target):
    """(params, plain decoding's seeded outputs): three tokens, the grammar after the likeliest first
    pair of tokens."""
    eng = Engine(planner=untimed, model_path=str(small_target), dtype="float32", max_total_tokens=32768,
                 max_running_requests=256)
    pairs = three_token_distribution(small_target, (-1, -1), eng.eos_ids)[:VOCAB, :VOCAB].sum(-1)
    pairs[eng.eos_ids], pairs[:, eng.eos_ids] = 0, 0
    end = divmod(int(pairs.flatten().argmax()), VOCAB)
    params = {**SAMPLED, "max_new_tokens": 3, "regex": AFTER, "reasoning_end": list(end)}
    outs = eng.generate(input_ids=[PROMPT] * SAMPLES, sampling_params=[{**params, "seed": i} for i in range(SAMPLES)])
    return params, [o["output_ids"] for o in outs], eng.eos_ids


def check_distribution(model_dir, params: dict, outputs: list[list[int]], eos_ids) -> None:
    counts = torch.zeros(VOCAB + 1, VOCAB + 1, VOCAB + 1)
    for ids in outputs:
        counts[tuple(ids + [VOCAB] * (3 - len(ids)))] += 1
    end = tuple(params["reasoning_end"])
    assert counts[end].sum() > 100, "the end sequence was sampled often enough to test what follows it"
    assert chi_square_p(counts, three_token_distribution(model_dir, end, eos_ids)) > 0.001


def test_sampling_across_the_boundary_is_the_constrained_target_distribution(small_target, sampled):
    check_distribution(small_target, *sampled)


@pytest.mark.parametrize("algo", ALGOS + ["prediction"])
def test_sampling_across_the_boundary_under_speculation(algo, small_target, sampled, tmp_path):
    """Where the first token is the end sequence's first, the second completes it in the draft and
    the third comes from that node's row (Predicted Outputs draft the sequence and a token after it).
    Seeded requests (the coupled rule) give plain decoding's tokens; unseeded ones (tree sampling)
    follow the constrained target distribution."""
    params, plain_outputs, eos_ids = sampled
    spec = {"speculative_sampling": "tree"} if algo == "prediction" else {
        # One level as wide as the vocabulary: whatever the draft model, the end sequence's second
        # token is drafted under its first.
        "speculative_algorithm": algo, "speculative_num_steps": 1, "speculative_eagle_topk": VOCAB,
        "speculative_num_draft_tokens": VOCAB + 1, "speculative_adaptive": "off", "speculative_sampling": "tree",
        **draft_setup(algo, small_target, tmp_path, vocab=VOCAB)}
    eng = Engine(planner=untimed, **{"model_path": str(small_target), **spec}, dtype="float32",
                 max_total_tokens=32768, max_running_requests=256)
    if algo == "prediction":
        params = {**params, "prediction": params["reasoning_end"] + [ALLOWED[0]]}
    seeded = eng.generate(input_ids=[PROMPT] * SAMPLES,
                          sampling_params=[{**params, "seed": i} for i in range(SAMPLES)])
    assert [o["output_ids"] for o in seeded] == plain_outputs
    unseeded = eng.generate(input_ids=[PROMPT] * SAMPLES, sampling_params=params)
    check_distribution(small_target, params, [o["output_ids"] for o in unseeded], eos_ids)
    if algo == "prediction":
        assert sum(o["meta_info"]["accepted_prediction_tokens"] for o in seeded + unseeded) > 100, \
            "predictions were accepted"
    else:
        assert eng.stats()["avg_spec_accept_length"] > 1.1, "drafts were accepted: the drafted rows' masks were used"
