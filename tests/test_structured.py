"""Logprobs, grammar-constrained decoding and logit_bias stay lossless under speculation, for every
algorithm.

- Logprobs: equal to the target's own log-softmax (transformers, full recomputation) at every emitted
  token, greedy and sampled, with and without speculation.
- Grammars: greedy output identical with and without speculation, and always valid; sampled output
  follows the constrained target distribution (chi-square on an 8-token vocabulary).
- logit_bias: -100 bans a token and +100 forces one, identically with and without speculation.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine import Engine
from engine.errors import RequestError
from engine.core.grammar import GrammarBackend, row_bitmask
from engine.core.sampling import SamplingBatch
from engine.core.sampling_params import SamplingParams
from tests.drafts import ALGOS, draft_setup
from tests.lossless import VOCAB, chi_square_p, prompts, spec_engine
from tests.planning import untimed
from tests.tiny import deep_schema, make_model, make_tokenizer, target_probs

GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "kind": {"enum": ["fox", "dog", "cat"]},
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}, "required": ["ok", "kind", "n"]}
JSON = {"temperature": 0, "max_new_tokens": 64, "json_schema": json.dumps(SCHEMA)}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("target"), "llama", seed=3)


@pytest.fixture(scope="module")
def hf_model(target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def plain(target):
    return Engine(planner=untimed, model_path=str(target), dtype="float32", max_total_tokens=8192,
                  constrained_json_disable_any_whitespace=True)


def reference_logprobs(hf_model, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of the target at each output position, by full recomputation: [n, V]."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits / temperature, dim=-1)


def check_logprobs(out: dict, reference: torch.Tensor, top: int) -> None:
    tokens, meta = out["output_ids"], out["meta_info"]
    got = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
    assert [t for _, t, _ in meta["output_token_logprobs"]] == tokens
    expected = reference[torch.arange(len(tokens)), torch.tensor(tokens)]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    for pos, alternatives in enumerate(meta["output_top_logprobs"]):
        assert len(alternatives) == top
        values, ids = reference[pos].topk(top)
        torch.testing.assert_close(torch.tensor([v for v, _, _ in alternatives]), values, atol=1e-4, rtol=1e-4)
        assert [t for _, t, _ in alternatives] == ids.tolist()


def test_plain_logprobs_are_the_targets(plain, hf_model):
    for prompt in prompts()[:2]:
        out = plain.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=3)
        ref = reference_logprobs(hf_model, prompt, out["output_ids"])
        check_logprobs(out, ref, 3)
        lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert lps == [top[0][0] for top in out["meta_info"]["output_top_logprobs"]]   # greedy: the best


@pytest.mark.parametrize("algo", ALGOS)
def test_speculative_logprobs_equal_plain(algo, target, tmp_path, plain, hf_model):
    eng = spec_engine(algo, target, tmp_path, (3, 2, 6))
    ps = prompts()
    want = dict(return_logprob=True, top_logprobs_num=2)
    ref_outs = plain.generate(input_ids=ps, sampling_params=GREEDY, **want)
    outs = eng.generate(input_ids=ps, sampling_params=GREEDY, **want)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref_outs]
    assert sum(o["meta_info"]["spec_verify_ct"] for o in outs) < sum(len(o["output_ids"]) for o in outs)
    for o, r in zip(outs, ref_outs):
        mine = torch.tensor([lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
        theirs = torch.tensor([lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    # Sampled: the tokens differ from plain decoding's, their logprobs are still the target's (at T).
    sampled = {"temperature": 0.7, "max_new_tokens": 16, "ignore_eos": True, "seed": 5}
    for prompt in (ps[0], ps[-1]):
        out = eng.generate(input_ids=prompt, sampling_params=sampled, **want)
        check_logprobs(out, reference_logprobs(hf_model, prompt, out["output_ids"], 0.7), 2)


def _valid(text: str) -> dict:
    value = json.loads(text)
    assert set(value) >= {"ok", "kind", "n"} and set(value) <= set(SCHEMA["properties"])
    assert isinstance(value["ok"], bool) and value["kind"] in ("fox", "dog", "cat") and 0 <= value["n"] <= 99
    assert all(t in ("a", "b") for t in value.get("tags", []))
    return value


def test_plain_json_schema_output_is_valid(plain):
    outs = plain.generate(input_ids=prompts(), sampling_params=JSON)
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o["text"]
        _valid(o["text"])
    sampled = plain.generate(input_ids=prompts(), sampling_params={**JSON, "temperature": 1.0, "seed": 3})
    assert all(_valid(o["text"]) for o in sampled)


def test_grammars_run_without_triton(target):
    """The CPU install leaves Triton out (requirements-cpu.txt): xgrammar must compile and mask without it,
    NGRAM's tree walk included."""
    code = f"""
import json, sys
sys.modules["triton"] = None            # `import triton` fails, as where it is not installed
from engine import Engine
eng = Engine(model_path={str(target)!r}, dtype="float32", speculative_algorithm="NGRAM")
outs = eng.generate(input_ids=[list(range(10, 30))] * 2, sampling_params=[
    {{"temperature": 0, "max_new_tokens": 12, "json_schema": {json.dumps(SCHEMA)!r}}},
    {{"temperature": 0, "max_new_tokens": 12, "regex": "[ab]{{3}}"}}])
print(json.dumps([o["text"] for o in outs]))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    texts = json.loads(done.stdout.splitlines()[-1])
    assert texts[1] in {a + b + c for a in "ab" for b in "ab" for c in "ab"}


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("shape", [(3, 1, 4), (3, 3, 8)], ids=["chain", "tree"])
def test_constrained_greedy_identical_to_plain(algo, shape, target, tmp_path, plain):
    eng = spec_engine(algo, target, tmp_path, shape, constrained_json_disable_any_whitespace=True)
    # A regex whose strings the prompt's own n-grams can draft, a schema, and an EBNF grammar, in one batch.
    repeat = prompts()[-1]
    text = plain.tokenizer.decode(repeat)
    ebnf = 'root ::= "one " ("two " | "three ")+ "four"'
    batch = [(p, JSON) for p in prompts()] + [
        (repeat, {"temperature": 0, "max_new_tokens": 40, "regex": f"({_escape(text[:12])})+x"}),
        (repeat, {"temperature": 0, "max_new_tokens": 40, "ebnf": ebnf})]
    ids, params = [p for p, _ in batch], [s for _, s in batch]
    expected = plain.generate(input_ids=ids, sampling_params=params)
    outs = eng.generate(input_ids=ids, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in expected]
    for o in outs[:len(prompts())]:
        _valid(o["text"])
    assert outs[-1]["text"].startswith("one ")
    if algo == "NGRAM":     # drafts were accepted: verification ran under the masks
        assert outs[-2]["meta_info"]["spec_verify_ct"] < len(outs[-2]["output_ids"])


def test_constrained_output_survives_preemption(target, tmp_path, plain):
    """Retracted requests resume from their committed grammar state: the same output as without."""
    eng = spec_engine("NGRAM", target, tmp_path, (3, 2, 6), max_total_tokens=90,
                      constrained_json_disable_any_whitespace=True)
    expected = plain.generate(input_ids=prompts(), sampling_params=JSON)
    outs = eng.generate(input_ids=prompts(), sampling_params=JSON)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in expected]
    assert eng.stats()["retractions"] > 0


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_grammar_errors_name_the_parameter(plain):
    for key, bad in (("json_schema", "{not json"), ("regex", "(unclosed"), ("ebnf", "root ::= ")):
        with pytest.raises(RequestError) as err:
            plain.generate(input_ids=[5, 6], sampling_params={key: bad})
        assert err.value.param == key
    for extra, param in (({"ignore_eos": True}, "ignore_eos"), ({"min_new_tokens": 3}, "min_new_tokens"),
                         ({"regex": "a"}, "regex")):
        with pytest.raises(RequestError) as err:
            SamplingParams.from_dict({"json_schema": "{}", **extra})
        assert err.value.param == param


def test_grammars_past_the_limits_are_refused_before_compiling(plain):
    """Nesting past MAX_DEPTH (schemas, regexes) and text past MAX_BYTES: a RequestError naming the
    parameter and the limit, without compiling (a 600-level schema would take minutes)."""
    import engine.core.grammar as grammar

    for key, text, limit in (("json_schema", deep_schema(600), "levels"),
                             ("regex", "(" * 100 + "a" + ")" * 100, "levels"),
                             ("ebnf", 'root ::= "' + "a" * grammar.MAX_BYTES + '"', "bytes")):
        with pytest.raises(RequestError, match=limit) as err:
            plain.compile_grammar(SamplingParams.from_dict({key: text}))
        assert err.value.param == key
    assert plain.compile_grammar(SamplingParams.from_dict({"json_schema": deep_schema(20)})) is not None
    assert grammar._json_depth(deep_schema(20)) == 41 and grammar._nesting(r"(a\(b(c))", "(", ")") == 2


def test_compiles_in_the_process_are_cut_short_and_cached(plain, monkeypatch):
    """The server's compiles run in a child process: cancelled (the client left) or past the time
    limit it is killed, and the next compile starts a new one; compiled grammars are kept by text."""
    import engine.core.grammar as grammar
    from engine.core.grammar_worker import CompileCancelled

    backend = GrammarBackend(plain.tokenizer, plain.model_config.vocab_size, plain.eos_ids, compile_timeout=0.0)
    monkeypatch.setattr(grammar, "MAX_DEPTH", 10_000)
    slow = deep_schema(1000)                                       # minutes of compiling
    try:
        with pytest.raises(CompileCancelled):
            backend.compile("json_schema", slow, cancelled=lambda: True)
        with pytest.raises(RequestError, match="grammar-compile-timeout"):
            backend.compile("json_schema", slow, cancelled=lambda: False)
        assert backend.worker.cut_short == 2
        backend.compile_timeout = 60.0
        first = backend.compile("regex", "[ab]{3}", cancelled=lambda: False)
        assert backend.compile("regex", "[ab]{3}", cancelled=lambda: False) is first
        assert backend.worker.cut_short == 2
        matcher = backend.matcher(first)
        ids = plain.tokenizer.encode("aba", add_special_tokens=False)
        assert all(matcher.accept_token(t) for t in ids)          # the grammar came back whole
        assert matcher.accept_token(plain.eos_ids[0]) and matcher.is_terminated()
    finally:
        backend.close()


def test_logit_bias_validation(plain):
    for bias in ({"x": 1}, {"01": 1}, {"5": 101}, {"5": "1"}, {"5": True}):
        with pytest.raises(RequestError) as err:
            SamplingParams.from_dict({"logit_bias": bias})
        assert err.value.param == "logit_bias"
    with pytest.raises(RequestError) as err:
        plain.generate(input_ids=[5, 6], sampling_params={"logit_bias": {"320": 1}})
    assert err.value.param == "logit_bias"


@pytest.mark.parametrize("algo", ALGOS)
def test_logit_bias_bans_and_forces_under_speculation(algo, target, tmp_path, plain):
    eng = spec_engine(algo, target, tmp_path, (3, 2, 6))
    ps = prompts()
    free = plain.generate(input_ids=ps, sampling_params=GREEDY)
    common = max(range(320), key=lambda t: sum(o["output_ids"].count(t) for o in free))
    for bias, check in (({str(common): -100}, lambda ids: common not in ids),
                        ({"77": 100}, lambda ids: set(ids) == {77})):
        params = {**GREEDY, "logit_bias": bias}
        expected = plain.generate(input_ids=ps, sampling_params=params)
        outs = eng.generate(input_ids=ps, sampling_params=params)
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in expected]
        assert all(check(o["output_ids"]) for o in outs)
    sampled = eng.generate(input_ids=ps, sampling_params={**GREEDY, "temperature": 1.0, "seed": 1,
                                                          "logit_bias": {str(common): -100}})
    assert all(common not in o["output_ids"] for o in sampled)


# ---------------------------------------------------------------------------------------- sampling
SAMPLES = 1500
# Tokens 3..7 of the tiny tokenizer are the characters ! " # $ %. The first output token is forced
# (3, from the prefill); the second must be one of 3..6, the third one of 5..7, whatever the drafts
# propose: the third comes from a drafted node's row whenever the second was a draft accepted.
REGEX = '![!"#$][#$%]'
SECOND, THIRD = [3, 4, 5, 6], [5, 6, 7]


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("small"), "llama", seed=5, vocab=VOCAB)


def constrained_distribution(model_dir, prompt, params: SamplingParams) -> torch.Tensor:
    """P(x2, x3 | prompt, x1 = 3) under the target masked to SECOND, then THIRD."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def probs(context, allowed):
        logits = model(torch.tensor([context])).logits[0, -1:]
        masked = torch.full_like(logits, float("-inf"))
        masked[:, allowed] = logits[:, allowed]
        return target_probs(masked, params, prompt, context[len(prompt):])[0]

    with torch.no_grad():
        second = probs(prompt + [3], SECOND)
        joint = torch.zeros(VOCAB, VOCAB)
        for a in SECOND:
            joint[a] = second[a] * probs(prompt + [3, a], THIRD)
    return joint


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("shape", [(3, 1, 4), (2, 3, 6)], ids=["chain", "tree"])
def test_constrained_sampling_matches_target_distribution(algo, shape, small_target, tmp_path):
    steps, topk, tokens = shape
    kw = {"model_path": str(small_target), **draft_setup(algo, small_target, tmp_path, vocab=VOCAB)}
    eng = Engine(planner=untimed,
                 dtype="float32", max_total_tokens=32768, max_running_requests=256, speculative_algorithm=algo,
                 speculative_num_steps=steps, speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens,
                 speculative_adaptive="off", **kw)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    sampling = {"temperature": 1.0}
    outs = eng.generate(input_ids=[prompt] * SAMPLES, sampling_params=[
        {**sampling, "max_new_tokens": 3, "regex": REGEX, "seed": 1000 + i} for i in range(SAMPLES)])
    counts = torch.zeros(VOCAB, VOCAB)
    for o in outs:
        first, a, b = o["output_ids"]
        assert first == 3
        counts[a, b] += 1
    expected = constrained_distribution(small_target, prompt, SamplingParams(**sampling))
    assert chi_square_p(counts, expected) > 0.001
    assert eng.stats()["avg_spec_accept_length"] > 1.1, "drafts were accepted: the drafted rows' masks were used"


def test_tree_bitmask_rows_follow_each_nodes_path(tmp_path):
    """Row i of a tree's bitmask allows what the grammar allows after node i's path; a node the
    grammar refuses gets an all-allowed row (it is never accepted, so never read)."""
    tok = make_tokenizer(tmp_path)
    backend = GrammarBackend(tok, 320, [1])
    ids = {tok.decode([i]): i for i in range(320)}
    matcher = backend.matcher(backend.compile("regex", "ab|ac|b"))
    req = SimpleNamespace(grammar=matcher)
    # root (committed) -> "a" -> "c", root -> "x" (refused), root -> "b"
    tree = [9, ids["a"], ids["x"], ids["c"], ids["b"]]
    bitmask, rows = row_bitmask([req], [5], 320, [tree], [[-1, 0, 0, 1, 0]])
    allowed = [{t for t in range(320) if bitmask[i, t // 32] >> (t % 32) & 1} for i in range(5)]
    assert allowed[0] == {ids["a"], ids["b"]} and allowed[1] == {ids["b"], ids["c"]}
    assert allowed[2] == set(range(320)) and allowed[3] == {1} and allowed[4] == {1} and rows == [0, 1, 2, 3, 4]
    assert matcher.accept_token(ids["b"])          # the walk left the matcher where it was
    logits = torch.zeros(5, 320)
    sb = SamplingBatch([SimpleNamespace(params=SamplingParams(), token_ids=[9], prompt_len=1, seed=0, grammar=None)],
                       [1], "cpu", rows_per_req=[5], bitmask=(bitmask, rows))
    probs = sb.probs(logits)
    assert set(probs[1].nonzero().flatten().tolist()) == {ids["b"], ids["c"]}


def test_ngram_drafts_only_what_the_grammar_allows(tmp_path):
    """An n-gram cache full of continuations the grammar refuses: the constrained tree holds none of
    them, the unconstrained one does."""
    from engine.speculative.ngram import ngram_tree
    from engine.speculative.ngram_cache import NgramCache
    from engine.core.grammar import DraftGrammar

    tok = make_tokenizer(tmp_path)
    ids = {tok.decode([i]): i for i in range(320)}
    a, b, c, x = ids["a"], ids["b"], ids["c"], ids["x"]
    cache = NgramCache(1, 3, 10_000, 20)
    seq = [a, x, x, a, b, c, a, x, a, b, a, x, x, x]
    cache.learn(seq, 0)
    backend = GrammarBackend(tok, 320, [1])
    matcher = backend.matcher(backend.compile("regex", "(ab|ac)+"))
    assert matcher.accept_token(a)          # the root, committed
    free = ngram_tree(cache, [a], steps=3, budget=8, breadth=lambda n, depth: 3)
    assert x in free.tokens
    tree = ngram_tree(cache, [a], steps=3, budget=8, breadth=lambda n, depth: 3, grammar=DraftGrammar(matcher))
    assert len(tree) > 1 and x not in tree.tokens
    for node in range(1, len(tree)):       # every path is a prefix the grammar takes after the committed "a"
        m = matcher.fork()
        assert all(m.accept_token(tree.tokens[i]) for i in tree.path_to(node)[1:])
    assert matcher.accept_token(b)          # the request's own matcher did not move


def test_a_token_the_grammar_refuses_fails_that_request_only(plain):
    """Masks make this impossible; if a bug ever lets one through, that request ends as an internal
    error (a 500 on the server) and the others go on."""
    from engine.server.serving import engine_abort

    class Refusing:
        def __init__(self, matcher):
            self.matcher = matcher

        def __getattr__(self, name):
            return getattr(self.matcher, name)

        def accept_token(self, token):
            return False

    params = {"max_new_tokens": 8, "temperature": 0}
    bad = plain.make_request([5, 6, 7], SamplingParams.from_dict({**params, "regex": "[a-z]+"}))
    good = plain.make_request([5, 6], SamplingParams.from_dict({**params, "ignore_eos": True}))
    bad.grammar = Refusing(bad.grammar)
    for r in (bad, good):
        plain.add_request(r)
    while not (bad.finished and good.finished):
        plain.step()
    assert bad.finish_reason.type == "abort" and good.finish_reason.type == "length"
    assert engine_abort(plain.output_dict(bad)).status == 500


def test_grammar_backend_none_refuses_constraints(target):
    eng = Engine(planner=untimed,
                 model_path=str(target), dtype="float32", max_total_tokens=1024, grammar_backend="none")
    with pytest.raises(RequestError) as err:
        eng.generate(input_ids=[5, 6], sampling_params={"regex": "a+"})
    assert err.value.param == "regex" and "--grammar-backend none" in str(err.value)
    assert eng.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})["output_ids"]
