"""NGRAM drafting: the n-gram cache, the draft trees built from it, the worker's per-request learning,
and end to end: greedy output identical to plain decoding, with drafts that really get accepted."""

from __future__ import annotations

import random

import pytest
import torch

from engine import Engine
from engine.config import ServerArgs
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.speculative.ngram import NgramDrafter, ngram_tree
from engine.core.step import DecodeStep
from engine.speculative.ngram_cache import NgramCache
from tests.planning import untimed
from tests.tiny import make_model

GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


def cache(min_window=1, max_window=3, capacity=1000, max_followers=8) -> NgramCache:
    return NgramCache(min_window, max_window, capacity, max_followers)


def worker(steps=4, topk=3, draft_tokens=8, **ngram) -> NgramDrafter:
    args = ServerArgs(speculative_algorithm="NGRAM", speculative_num_steps=steps, speculative_eagle_topk=topk,
                      speculative_num_draft_tokens=draft_tokens, **ngram)
    return NgramDrafter(args, "cpu")      # drafting needs no model


def request(prompt: list[int]) -> Request:
    return Request("r", list(prompt), SamplingParams(), seed=0)


# ------------------------------------------------------------------ the cache
def test_match_takes_longest_suffix_with_followers():
    c = cache()
    c.learn([1, 2, 3, 4, 5], 0)
    c.learn([7, 3, 4, 6], 0)
    assert c.match([2, 3, 4]) == (3, {5: 1})
    assert c.match([9, 3, 4]) == (2, {5: 1, 6: 1})        # (9, 3, 4) unseen: falls back to (3, 4)
    assert c.match([2, 3, 4], longest=1) == (1, {5: 1, 6: 1})
    assert c.match([8]) == (0, None)
    assert c.match([5]) == (0, None)                       # seen, but never followed by anything


def test_min_window_skips_short_contexts():
    c = cache(min_window=2)
    c.learn([1, 2, 3], 0)
    assert c.match([2]) == (0, None)
    assert c.match([1, 2]) == (2, {3: 1})


def test_incremental_learning_equals_learning_at_once():
    rng = random.Random(0)
    tokens = [rng.randrange(5) for _ in range(200)]
    once, pieces = cache(max_window=4), cache(max_window=4)
    once.learn(tokens, 0)
    done = 0
    while done < len(tokens):
        n = done + rng.randrange(1, 9)
        start = max(0, done - 4)             # only the window's worth of history is passed
        pieces.learn(tokens[start:n], done - start)
        done = min(n, len(tokens))
    assert once._followers == pieces._followers


def test_capacity_evicts_least_recently_learned():
    c = cache(min_window=2, max_window=2, capacity=3)
    c.learn([1, 2, 3, 4], 0)                 # contexts (1,2) (2,3)
    c.learn([5, 6, 7], 0)                    # (5,6): full
    c.learn([1, 2, 3], 0)                    # (1,2) learned again: now the most recent
    c.learn([8, 9, 10], 0)                   # (8,9) in, the least recent (2,3) out
    assert len(c) == 3
    assert c.match([2, 3]) == (0, None)
    assert c.match([1, 2]) == (2, {3: 2})
    assert c.match([5, 6])[0] == 2 and c.match([8, 9])[0] == 2


def test_follower_cap_drops_least_frequent_oldest():
    c = cache(min_window=1, max_window=1, max_followers=2)
    c.learn([0, 1, 0, 1, 0, 2, 0, 3], 0)     # after 0: 1 twice, then 2, then 3 (2 makes room)
    assert c.match([0]) == (1, {1: 2, 3: 1})


# ------------------------------------------------------------------ the trees
def test_no_match_gives_root_alone():
    tree = ngram_tree(cache(), [4, 5, 6], steps=4, budget=7, breadth=lambda n, d: 3)
    assert tree.tokens == [6] and tree.parents == [-1]


def test_certain_continuation_drafts_a_full_chain():
    c = cache()
    c.learn([10, 11, 12, 13, 14, 15, 16, 17], 0)
    tree = ngram_tree(c, [9, 10, 11], steps=4, budget=7, breadth=lambda n, d: 3)
    assert tree.tokens == [11, 12, 13, 14, 15] and tree.is_chain


def test_children_ordered_by_frequency_then_recency():
    c = cache(max_window=1)
    c.learn([5, 1, 5, 2, 5, 1, 5, 3], 0)     # after 5: 1 twice, 2 once, 3 once (most recent)
    tree = ngram_tree(c, [5], steps=1, budget=3, breadth=lambda n, d: 3)
    assert [t for t, p in zip(tree.tokens, tree.parents) if p == 0] == [1, 3, 2]
    narrow = ngram_tree(c, [5], steps=1, budget=3, breadth=lambda n, d: 2)
    assert narrow.tokens == [5, 1, 3]


def test_budget_keeps_the_most_probable_paths():
    c = cache(max_window=2)
    # After 0: 1 three times (always followed by 2, then 3), 4 once (followed by 9).
    c.learn([0, 1, 2, 3, 0, 1, 2, 3, 0, 4, 9, 7, 0, 1, 2, 3], 0)
    tree = ngram_tree(c, [0], steps=3, budget=3, breadth=lambda n, d: 2)
    assert tree.tokens == [0, 1, 2, 3] and tree.is_chain  # p = .75 each, over 4's .25


@pytest.mark.parametrize("steps,budget,width", [(1, 1, 1), (3, 4, 2), (6, 10, 4), (8, 15, 10)])
def test_tree_respects_budget_depth_and_breadth(steps, budget, width):
    rng = random.Random(steps)
    c = cache(max_window=4)
    c.learn([rng.randrange(6) for _ in range(3000)], 0)
    for _ in range(50):
        context = [rng.randrange(6) for _ in range(6)]
        tree = ngram_tree(c, context, steps, budget, breadth=lambda n, d: width)
        assert tree.tokens[0] == context[-1]
        assert 1 < len(tree) <= budget + 1 and max(tree.depths) <= steps
        assert tree.max_children <= width
        for node in range(1, len(tree)):
            path = [tree.tokens[i] for i in tree.path_to(node)]
            assert c.match(context + path[1:-1])[1].get(path[-1]), "each child is a seen follower"


def test_wide_tree_fills_the_largest_size_its_flags_allow():
    """(3, 4, 16) verifies 16 tokens, more than steps * topk + 1: each node has its own children, so a
    varied cache fills the whole budget, and the breadth per depth (4, 3, 2 here) bounds each node."""
    rng = random.Random(1)
    c = cache(max_window=2)
    c.learn([rng.randrange(6) for _ in range(5000)], 0)
    widths = {0: 4, 1: 3, 2: 2}
    tree = ngram_tree(c, [1, 2], steps=3, budget=15, breadth=lambda n, d: widths[d])
    assert len(tree) == 16
    children = [[i for i, p in enumerate(tree.parents) if p == node] for node in range(len(tree))]
    assert all(len(kids) <= widths[tree.depths[node]] for node, kids in enumerate(children))


def test_breadth_narrows_with_match_length_and_depth_within_bounds_and_topk():
    w = worker(topk=5, steps=4, draft_tokens=8, speculative_ngram_min_bfs_breadth=2,
               speculative_ngram_max_bfs_breadth=8, speculative_ngram_min_match_window_size=1,
               speculative_ngram_max_match_window_size=7)
    widths = [w.breadth(n, 0) for n in range(1, 8)]
    assert widths == sorted(widths, reverse=True)
    assert widths[0] == 5 and widths[-1] == 2                # topk caps the widest; min_bfs the narrowest
    deeper = [w.breadth(4, d) for d in range(6)]
    assert deeper == sorted(deeper, reverse=True) and deeper[-1] == 1     # a step less per level, at least 1
    uncapped = worker(topk=10, steps=4, draft_tokens=8, speculative_ngram_max_match_window_size=7)
    assert uncapped.breadth(1, 0) == 8 and uncapped.breadth(7, 0) == 1
    chain = worker(topk=1, steps=4, draft_tokens=5)
    assert all(chain.breadth(n, d) == 1 for n in range(1, 13) for d in range(4))


def test_breadth_flags_act_without_tree_flags():
    """As in SGLang: with the tree flags left out (or the draft tokens alone, the guide's NGRAM example)
    the branching is --speculative-ngram-max-bfs-breadth, whatever the target's family."""
    args = ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=16,
                      speculative_ngram_max_bfs_breadth=6)
    assert args.speculative_tree == (15, 6, 16)
    w = NgramDrafter(args, "cpu")
    assert w.breadth(1, 0) == 5 and w.breadth(12, 0) == 1
    assert ServerArgs(speculative_algorithm="NGRAM").speculative_tree == (11, 10, 12)


# ------------------------------------------------------------------ the worker's state
def test_worker_learns_incrementally_and_shares_across_requests():
    w = worker(steps=3, topk=1, draft_tokens=4)
    a = request([20, 21, 22, 23, 24, 25])
    b = request([7, 21, 22])
    a.row, b.row = 0, 1                                    # its state is kept by table row
    trees = w.draft(DecodeStep([a, b], torch.zeros(2, 4, dtype=torch.long)))
    assert w.learned[a.row] == 6 and w.learned[b.row] == 3
    assert trees.tokens[1].tolist() == [22, 23, 24, 25]      # b is drafted from a's prompt
    a.token_ids += [30, 31]
    w.draft(DecodeStep([a], torch.zeros(1, 4, dtype=torch.long)))
    assert w.learned[a.row] == 8 and w.cache.match([25, 30])[1] == {31: 1}
    a.token_ids.append(32)
    w.release(a)                                           # the last tokens are learned, the state dropped
    assert a.row not in w.learned and w.cache.match([31])[1] == {32: 1}


def test_evidence_is_the_length_of_the_longest_match_learned_first():
    """The scheduler sizes a request's draft by how long a context of its text was seen before: the
    request's own newest tokens are learned first, so a phrase repeating within it counts."""
    w = worker(steps=3, topk=1, draft_tokens=4)
    a = request([20, 21, 22, 23, 24, 25, 20, 21, 22])
    a.row = 0
    assert w.evidence(a) == 3                              # "20 21 22" was followed by 23 before
    assert w.learned[a.row] == 9
    b = request([7, 8, 9])
    b.row = 1
    assert w.evidence(b) == 0                              # no context of it seen followed by anything
    b.token_ids.append(22)
    assert w.evidence(b) == 1


# ------------------------------------------------------------------ end to end
@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # A tiny model's matmuls are too small to split: on a busy CPU, handing them between threads costs
    # several times the math itself.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("llama"), "llama")


def engine(model_dir, **kw) -> Engine:
    return Engine(planner=untimed, model_path=str(model_dir), dtype="float32", max_total_tokens=4096, **kw)


def ngram_engine(model_dir, shape=None) -> Engine:
    """shape: (steps, topk, draft tokens), or None for the auto choice."""
    steps, topk, draft_tokens = shape or (None, None, None)
    return engine(model_dir, speculative_algorithm="NGRAM", speculative_adaptive="off", speculative_num_steps=steps,
                  speculative_eagle_topk=topk, speculative_num_draft_tokens=draft_tokens)


def test_greedy_identical_to_plain_decoding(llama_dir):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 17, 30)]
    prompts += [list(range(40, 48)) * 6, prompts[1] * 3]          # repetitive prompts: drafts get proposed
    plain = [o["output_ids"] for o in engine(llama_dir).generate(input_ids=prompts, sampling_params=GREEDY)]
    for shape in [(8, 4, 16), (3, 1, 4), (2, 2, 3), None]:     # None: auto, (5, 4, 8) for Llama
        eng = ngram_engine(llama_dir, shape)
        out = eng.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [o["output_ids"] for o in out] == plain, shape
        assert eng.stats()["avg_spec_accept_length"] > 1               # some drafts were accepted


def test_acceptance_on_text_seen_before(llama_dir):
    # This tiny random model does not continue a repeated pattern, so the text to predict is its own
    # greedy output: the first request teaches the shared cache that output, and the same prompt again
    # then finds every context with the very token the target chooses next (greedy is deterministic),
    # so nearly whole chains are accepted, ~8 tokens per verify against ~1.4 for the unseen first run.
    # Engine-wide, 40 tokens in ~30 verifies plus 3 x 40 in ~5 each is ~3.5: > 2 with a wide margin.
    prompt = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    eng = ngram_engine(llama_dir, (8, 4, 16))
    first = eng.generate(input_ids=prompt, sampling_params=GREEDY)
    again = eng.generate(input_ids=[prompt] * 3, sampling_params=GREEDY)
    assert all(o["output_ids"] == first["output_ids"] for o in again)
    assert all(o["meta_info"]["spec_accept_length"] > 4 for o in again)
    assert eng.stats()["avg_spec_accept_length"] > 2
    assert not eng.debug.drafter.learned       # every finished request's state is gone
