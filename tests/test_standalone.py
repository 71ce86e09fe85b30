"""STANDALONE speculative decoding: the EAGLE-2 tree search on a hand-computed example, greedy outputs
identical to plain decoding over several tree shapes, full acceptance with the target as its own draft
(also across retraction and across a radix-cached conversation turn: the draft shares the target's
cache), FR-Spec maps, and draft/target vocabulary checks."""

from __future__ import annotations

import pytest
import torch

from engine import ConfigError, Engine
from engine.core.sampling_params import SamplingParams
from engine.speculative.draft_tree_search import search_trees, top_k
from tests.compiler import require
from tests.greedy import GREEDY, generate, prompts
from tests.planning import untimed
from tests.tiny import make_model, make_tokenizer


def noisy_copy(src, dst, noise: float, seed: int = 0):
    """The target with every weight perturbed: a draft that agrees with it often, not always."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    model.save_pretrained(dst)
    make_tokenizer(dst)
    return dst


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, target_dir):
    return noisy_copy(target_dir, tmp_path_factory.mktemp("draft"), noise=0.01)


def engine(target, draft=None, tree=None, **kw) -> Engine:
    spec = {}
    if draft is not None:
        steps, topk, tokens = tree
        spec = dict(speculative_algorithm="STANDALONE", speculative_adaptive="off",
                    speculative_draft_model_path=str(draft), speculative_num_steps=steps,
                    speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens)
    kw.setdefault("max_total_tokens", 4096)
    return Engine(planner=untimed, model_path=str(target), dtype="float32", **spec, **kw)


@pytest.fixture(scope="module")
def plain_outputs(target_dir):
    ps = prompts(5, seed=1)
    return ps, generate(engine(target_dir), ps)


# ------------------------------------------------------------------ the tree search itself
# A bigram draft: a node's next-token distribution depends on its token only.
ROOT = [0.5, 0.35, 0.05, 0.05, 0.05]
NEXT = {0: [0.05, 0.1, 0.6, 0.2, 0.05], 1: [0.9, 0.04, 0.03, 0.02, 0.01], 2: [0.2, 0.1, 0.05, 0.6, 0.05],
        3: [0.7, 0.1, 0.1, 0.05, 0.05], 4: [0.1, 0.1, 0.1, 0.1, 0.6]}


def bigram_expand(calls: list):
    def expand(depth: int, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        calls.append((depth, tokens.tolist(), parents.tolist()))
        return torch.tensor([[NEXT[t] for t in row] for row in tokens.tolist()]).log()
    return expand


def nodes(trees, b: int = 0) -> tuple[list[int], list[int]]:
    return trees.tokens[b].tolist(), trees.parents[b].tolist()


def test_tree_search_hand_computed():
    # Path probabilities: [0] .5, [1] .35, [1 0] .315, [0 2] .30, [1 0 2] .189, [0 2 3] .18, [0 3] .10,
    # [1 0 3] .063, [0 2 0] .06, [1 1] .014. Depth-2 frontier: [1 0], [0 2] (best two of four).
    calls: list = []
    six, eight = [search_trees(torch.tensor([9]), torch.tensor([ROOT]).log(), bigram_expand(calls), 3, 2, n)
                  for n in (6, 8)]
    # Best five, breadth first, siblings by score.
    assert nodes(six) == ([9, 0, 1, 0, 2, 2], [-1, 0, 0, 2, 1, 3])
    assert nodes(eight) == ([9, 0, 1, 0, 2, 3, 2, 3], [-1, 0, 0, 2, 1, 1, 3, 4])
    assert six.draft_probs is None and not six.is_chain and six.sizes == [6]
    depth1, depth2 = calls[:2]          # one call per forwarded depth: (depth, tokens, parents' frontier index)
    assert depth1 == (1, [[0, 1]], [[0, 0]])
    assert depth2 == (2, [[0, 2]], [[1, 0]])       # [1 0] comes from frontier node 1, [0 2] from node 0


def test_tree_search_chain_batch_and_impossible_tokens():
    roots = torch.tensor([ROOT, [0.0, 0.0, 1.0, 0.0, 0.0]]).log()     # second: only token 2 is possible
    chain = search_trees(torch.tensor([9, 9]), roots, bigram_expand([]), 3, 1, 4)
    assert chain.tokens.tolist() == [[9, 0, 2, 3], [9, 2, 3, 0]] and chain.is_chain
    # Batched search equals one search per request; possible tokens come before impossible ones, which
    # only fill what is left (verification is exact whatever they are).
    both = search_trees(torch.tensor([9, 9]), roots, bigram_expand([]), 2, 2, 5)
    alone = search_trees(torch.tensor([9]), roots[1:], bigram_expand([]), 2, 2, 5)
    assert nodes(both, 1) == nodes(alone)
    tokens, parents = nodes(alone)
    assert tokens[1] == 2 and [t for t, p in zip(tokens, parents) if p == 1] == [3, 0]


@pytest.mark.parametrize("vocab", [49152, 151936, 5000])
def test_blocked_top_k_is_topk_over_a_vocabulary(vocab):
    """The search ranks children by blocks (their maxima first): the same values and tokens as topk,
    with -inf outside a draft vocabulary, rows whose best tokens share a block, a partial last block."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(2, 3, vocab, generator=g)
    x[0, :, vocab // 5:] = float("-inf")
    x[1, 0, 256:260] = 10.0 + torch.arange(4.0)             # the four best in one block
    for k in (1, 4, 10):
        values, ids = top_k(x, k)
        expected = x.topk(k, dim=-1)
        assert torch.equal(values, expected.values) and torch.equal(ids, expected.indices)


def test_sampler_draws_chain_and_returns_its_distributions():
    seen = []

    def draw(depth: int, scores: torch.Tensor):
        seen.append(depth)
        return torch.tensor([4 - depth]), torch.softmax(scores, -1), torch.tensor([True])

    tree = search_trees(torch.tensor([9]), torch.tensor([ROOT]).log(), bigram_expand([]), 2, 1, 3, draw)
    assert seen == [1, 2] and tree.tokens.tolist() == [[9, 3, 2]]
    expected = torch.cat([torch.zeros(1, 5), torch.tensor([ROOT, NEXT[3]]).log().softmax(-1)])
    torch.testing.assert_close(tree.draft_probs[0], expected)


# ------------------------------------------------------------------ end to end
@pytest.mark.parametrize("tree", [(3, 1, 4), (3, 2, 6), (2, 4, 8)])
def test_greedy_identical_to_plain(target_dir, draft_dir, plain_outputs, tree):
    ps, ref = plain_outputs
    eng = engine(target_dir, draft_dir, tree)
    assert generate(eng, ps) == ref
    stats = eng.stats()
    assert 1.5 < stats["avg_spec_accept_length"] < tree[0] + 1      # real, partial acceptance
    assert stats["kv_tokens_used"] == 0


def test_small_independent_draft(tmp_path, target_dir, plain_outputs):
    ps, ref = plain_outputs
    small = make_model(tmp_path, "llama", layers=1, hidden=32, seed=5)
    assert generate(engine(target_dir, small, (2, 2, 4)), ps) == ref


@pytest.mark.parametrize("tree", [(3, 1, 4), (2, 4, 8)])
def test_target_as_own_draft_accepts_everything(confident_dir, tree):
    ps = prompts(5, seed=1)
    eng = engine(confident_dir, confident_dir, tree)
    assert generate(eng, ps) == generate(engine(confident_dir), ps)
    assert eng.stats()["avg_spec_accept_length"] == tree[0] + 1


def test_draft_keeps_its_context_across_a_radix_hit(confident_dir):
    """Turn two extends turn one, which the radix cache holds: the draft's cache for that prefix is
    shared with the target's, so the own-model draft is accepted whole from the first step."""
    eng = engine(confident_dir, confident_dir, (3, 1, 4))
    first_prompt = prompts(1, seed=3, lo=20, hi=21)[0]
    first = eng.generate(input_ids=first_prompt, sampling_params=GREEDY)
    second = eng.generate(input_ids=first_prompt + first["output_ids"] + [11, 12, 13], sampling_params=GREEDY)
    assert second["meta_info"]["cached_tokens"] >= len(first_prompt) + len(first["output_ids"]) - 1
    assert second["meta_info"]["spec_accept_length"] == 4


@pytest.mark.parametrize("radix", [True, False])
def test_retraction_keeps_outputs_and_draft_state(confident_dir, radix):
    ps = prompts(6, seed=6, lo=10, hi=20)
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    ref = generate(engine(confident_dir), ps, params)
    eng = engine(confident_dir, confident_dir, (3, 1, 4), max_total_tokens=100, disable_radix_cache=not radix)
    assert generate(eng, ps, params) == ref
    stats = eng.stats()
    assert stats["retractions"] > 0
    # Full acceptance throughout: a re-admitted request's draft has its cache for what is cached.
    assert stats["avg_spec_accept_length"] == 4
    assert stats["kv_tokens_used"] == 0


def test_sampled_chain_uses_the_request_distribution(target_dir):
    # Drawn from the same processed distribution the target samples from, self-drafts are accepted
    # (almost) always by rejection sampling: p/q is 1 up to rounding.
    eng = engine(target_dir, target_dir, (3, 1, 4))
    params = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "max_new_tokens": 32, "ignore_eos": True, "seed": 7}
    out = eng.generate(input_ids=prompts(3, seed=8), sampling_params=params)
    assert all(len(o["output_ids"]) == 32 for o in out)
    assert eng.stats()["avg_spec_accept_length"] > 3.9


def test_token_map_restricts_drafts_keeps_output(tmp_path, target_dir, draft_dir, plain_outputs):
    ps, ref = plain_outputs
    hot = torch.randperm(320, generator=torch.Generator().manual_seed(0))[:160]
    path = tmp_path / "freq_160.pt"
    torch.save(hot.tolist(), path)
    eng = engine(target_dir, draft_dir, (3, 2, 6), speculative_token_map=str(path))
    drafted = []
    drafter = eng.debug.drafter
    draft = drafter.draft

    def recording(step):
        trees = draft(step)
        drafted.extend(trees.tokens[:, 1:].flatten().tolist())
        return trees

    drafter.draft = recording
    assert generate(eng, ps) == ref
    assert drafted and set(drafted) <= set(hot.tolist())


@pytest.mark.parametrize("quantization", ["none", "w4a8"])
def test_token_map_rows_run_as_the_drafts_head_would(tmp_path, target_dir, draft_dir, quantization):
    """The map's rows run as the draft's full head would: in bfloat16 in bf16; under w4a8 in the draft's
    4-bit kernel (they stayed the quantized head's dequantized fp32 rows, and the first draft step
    failed on bf16 hidden states). Greedy output stays plain decoding's, compared under w4a8, whose rows
    do not depend on the call's other rows (bf16's matmuls may break ties differently)."""
    from engine.models.quant import W4A8Linear
    from spec_kernels import cpu_w4a8

    if quantization == "w4a8":
        require(cpu_w4a8._kernel)
    path = tmp_path / "freq_160.pt"
    torch.save(torch.randperm(320, generator=torch.Generator().manual_seed(1))[:160].tolist(), path)
    common = dict(model_path=str(target_dir), dtype="bfloat16", quantization=quantization, max_total_tokens=4096)
    eng = Engine(planner=untimed, **common, speculative_algorithm="STANDALONE",
                 speculative_adaptive="off", speculative_draft_model_path=str(draft_dir),
                 speculative_num_steps=2, speculative_eagle_topk=2, speculative_num_draft_tokens=4,
                 speculative_draft_model_quantization=quantization, speculative_token_map=str(path))
    head = eng.debug.drafter.model.draft_head
    assert (type(head.matmul) is W4A8Linear) == (quantization == "w4a8")
    ps = prompts(3, seed=5)
    out = generate(eng, ps)
    assert [len(o) for o in out] == [GREEDY["max_new_tokens"]] * 3
    if quantization == "w4a8":
        assert out == generate(Engine(planner=untimed, **common), ps)


def test_full_token_map_with_own_draft_accepts_everything(tmp_path, target_dir, plain_outputs):
    ps, ref = plain_outputs
    path = tmp_path / "all.pt"
    torch.save(torch.randperm(320), path)
    eng = engine(target_dir, target_dir, (3, 1, 4), speculative_token_map=str(path))
    assert generate(eng, ps) == ref
    assert eng.stats()["avg_spec_accept_length"] == 4


def test_one_draft_forward_a_step_with_requests_joining(target_dir, draft_dir):
    """After a verification one draft forward feeds the accepted drafts and the bonus, whose K/V is parked
    and whose scores start the next step: a step with a one-step tree runs no other draft forward, but
    for a request's first step, which feeds its prompt with the root (the prefill feeds the draft
    nothing). Requests join while others decode (2 run at most), and outputs stay plain decoding's."""
    ps = prompts(4, seed=11)
    params = [{**GREEDY, "max_new_tokens": n} for n in (9, 24, 13, 20)]
    ref = [o["output_ids"] for o in engine(target_dir, max_running_requests=2).generate(input_ids=ps,
                                                                                        sampling_params=params)]
    eng = engine(target_dir, draft_dir, (1, 2, 3), max_running_requests=2)
    drafter, calls = eng.debug.drafter, {"feed": 0, "draft": 0, "after_prefill": 0}

    def counted(name):
        fn = getattr(drafter, name)

        def count(*args):
            calls[name] += 1
            return fn(*args)
        return count

    for name in calls:
        setattr(drafter, name, counted(name))
    assert [o["output_ids"] for o in eng.generate(input_ids=ps, sampling_params=params)] == ref
    steps = calls["draft"]
    assert steps > 10 and steps < calls["feed"] <= steps + len(ps), calls
    assert not drafter.parked       # released with their requests


def test_vocabulary_checks(tmp_path, target_dir, plain_outputs):
    small = make_model(tmp_path / "v256", "llama", vocab=256, seed=3)
    with pytest.raises(ConfigError, match=r"\(256 tokens\).*\(320 tokens\)"):
        engine(target_dir, small, (2, 1, 3))
    # A padded vocabulary with the same tokenizer is fine: drafts stay within the target's.
    ps, ref = plain_outputs
    padded = make_model(tmp_path / "v384", "llama", vocab=384, seed=3)
    assert generate(engine(target_dir, padded, (2, 2, 4)), ps) == ref


def test_set_speculative_switches_without_reloading(target_dir, draft_dir, plain_outputs):
    """Tree shapes and plain decoding in turn on one engine: outputs stay the target's, the loaded
    draft model is reused, and a switch while requests run is refused."""
    ps, ref = plain_outputs
    eng = engine(target_dir, draft_dir, (3, 1, 4))
    model = eng.debug.drafter.model
    for tree in [(2, 2, 4), None, (3, 1, 4)]:
        if tree is None:
            eng.set_speculative(speculative_algorithm=None)
        else:
            eng.set_speculative(speculative_algorithm="STANDALONE", speculative_draft_model_path=str(draft_dir),
                                **dict(zip(("speculative_num_steps", "speculative_eagle_topk",
                                            "speculative_num_draft_tokens"), tree)))
        assert generate(eng, ps) == ref
        assert ("spec_verify_ct" in eng.stats()) == (tree is not None)
        assert tree is None or eng.debug.drafter.model is model
    eng.add_request(eng.make_request(ps[0], SamplingParams(**GREEDY)))
    with pytest.raises(ConfigError, match="between requests"):
        eng.set_speculative(speculative_algorithm=None)
