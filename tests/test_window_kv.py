"""Sliding-window layers' K/V in a pool of their own whose slots are freed once the window has passed
(engine/memory/window_pool.py): tiny Gemma-3-like (two local layers per global one) and Mistral-like (every
layer windowed) models, transformers' own classes, with a window of 8 and contexts many windows long, in a
window pool far smaller than the tokens they hold: transformers' greedy tokens under plain decoding and every
speculative algorithm, a continued conversation reusing its cached prefix and a prefix whose window was freed
recomputed, the window pool holding one window per request as decoding proceeds, under tensor parallelism
too, and the memory budget; every
attention backend reading a window pool whose out-of-window slots were freed and reused; the radix cache's
count of the window slots its nodes hold."""

from __future__ import annotations

import pytest
import torch

from engine.memory.budget import KVBudget, slot_bytes
from engine.memory.kv_pool import KVPool
from engine.memory.radix_cache import RadixCache
from engine.memory.window_pool import SlidingLayout, WindowedSlotAllocator, WindowPool
from tests.attention_cases import HKV, SLOTS, Gathering, ThroughKernel, build, dense_reference, draft_frontier, extend, tree
from tests.drafts import ALGOS, draft_setup
from tests.tiny import make_model, random_prompts, reference_greedy, tiny_engine

WINDOW = 8
D_SCALE = 16 ** -0.5
FAMILIES = {
    "gemma3": dict(layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                   query_pre_attn_scalar=24),
    "mistral": dict(layers=2),
}
GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
# A window pool of 102 slots (a tenth of the full pool's 1024), prompts prefilled in pieces of 16.
SMALL = dict(max_total_tokens=1024, swa_full_tokens_ratio=0.1, chunked_prefill_size=16)


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request, tmp_path_factory):
    return make_model(tmp_path_factory.mktemp(request.param), request.param, sliding_window=WINDOW,
                      **FAMILIES[request.param])


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, seed=5, lo=40, hi=60)


@pytest.fixture(scope="module")
def expected(model, prompts):
    return [reference_greedy(model, p, GREEDY["max_new_tokens"]) for p in prompts]


def generate(eng, prompts):
    return [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]


def test_contexts_many_windows_long_fit_a_small_window_pool(model, prompts, expected):
    """Three requests of about 100 tokens each hold more than the window pool's 102 slots together: they
    run side by side, none retracted, only because what left their windows was freed."""
    eng = tiny_engine(model, **SMALL)
    kv = eng.debug.kv
    assert (kv.capacity, kv.window_pool().slots, kv.usage()) == (1024, 102, (0, 0))
    assert sum(len(p) + GREEDY["max_new_tokens"] for p in prompts) > 102
    assert generate(eng, prompts) == expected
    assert eng.stats()["retractions"] == 0
    # Finished, each request's tokens are in the radix cache, the global layers' K/V of every one of them
    # and the windowed layers' of its last window only.
    kept = sum(len(p) + GREEDY["max_new_tokens"] - 1 for p in prompts)
    assert kv.usage() == (kept, 3 * (WINDOW - 1))


def test_window_slots_are_freed_as_decoding_proceeds(model, prompts):
    """Step by step, a request holds a full slot for each of its tokens and a window slot for its last
    window - 1 only (the next query reads no more), from its prefill's first pieces to its last token."""
    from engine.core.sampling_params import SamplingParams

    eng = tiny_engine(model, disable_radix_cache=True, **SMALL)
    req = eng.make_request(prompts[0], SamplingParams.from_dict(GREEDY))
    eng.add_request(req)
    usage = []
    while not req.finished:
        eng.step()
        usage.append((eng.debug.kv.usage(), req.kv_len))
    assert len(usage) > GREEDY["max_new_tokens"] and usage[-1] == ((0, 0), 0)
    for (full, window), committed in usage[:-1]:
        assert full == committed and window == min(committed, WINDOW - 1)


@pytest.mark.parametrize("algo", [None, "EAGLE"])
def test_a_continued_conversation_reuses_its_prefix(model, prompts, algo, tmp_path):
    """The next turn of a conversation matches the whole previous one, whose last window is held: it is
    reused. A prompt sharing only an early part matches where the window was freed: it is recomputed,
    and both give transformers' tokens."""
    spec = draft_setup(algo, model, tmp_path) if algo else {}
    eng = tiny_engine(model, algo, tree=(3, 2, 5), **SMALL, **spec)
    first = eng.generate(input_ids=prompts[0], sampling_params=GREEDY)
    turn = prompts[0] + first["output_ids"] + [7, 8, 9]
    params = {**GREEDY, "max_new_tokens": 12}
    out = eng.generate(input_ids=turn, sampling_params=params)
    assert out["output_ids"] == reference_greedy(model, turn, 12)
    assert out["meta_info"]["cached_tokens"] == len(prompts[0]) + GREEDY["max_new_tokens"] - 1
    branch = prompts[0][:30] + [5, 6]
    out = eng.generate(input_ids=branch, sampling_params=params)
    assert out["output_ids"] == reference_greedy(model, branch, 12)
    assert out["meta_info"]["cached_tokens"] == 0


def test_a_conversation_of_short_turns_holds_one_window_of_its_prefix(model):
    """Turns shorter than the window free nothing of their own; locking the conversation's cached prefix
    frees its window slots before the last window instead (no other request holds them). The conversation
    outgrows the window pool, each turn reuses all of it and gives transformers' tokens."""
    from engine.core.sampling_params import SamplingParams

    eng = tiny_engine(model, **SMALL)
    params = SamplingParams.from_dict({**GREEDY, "max_new_tokens": 2})
    ids = random_prompts(1, seed=9, lo=10, hi=11)[0]
    while len(ids) < 2 * 102:
        req = eng.make_request(ids, params)
        eng.add_request(req)
        for _ in range(20):             # a turn that could never be admitted would wait for ever
            if not req.finished:
                eng.step()
        assert req.output_ids == reference_greedy(model, ids, 2)
        assert req.cached_tokens == (len(ids) - 4 if len(ids) > 10 else 0)
        assert eng.debug.kv.usage()[1] <= 2 * WINDOW
        ids = ids + req.output_ids + [5, 6, 7]


@pytest.mark.parametrize("algo", ALGOS)
def test_every_algorithm_is_lossless(model, prompts, expected, algo, tmp_path):
    """Draft tokens under verification read their window; rejected ones are freed with their window slots."""
    spec = draft_setup(algo, model, tmp_path)
    eng = tiny_engine(spec.pop("model_path", model), algo, tree=(3, 2, 5), **SMALL, **spec)
    assert generate(eng, prompts) == expected
    assert eng.stats()["retractions"] == 0


@pytest.mark.parametrize("algo", [None, "NGRAM", "EAGLE3"])
def test_tensor_parallel_ranks_read_the_window_slots_rank_0_hands_out(model, prompts, expected, algo, tmp_path):
    """Two ranks: rank 0 alone hands out and frees window slots, reused across requests in a pool this
    small; the other rank writes and reads its heads' K/V through the map entries each forward brings."""
    spec = draft_setup(algo, model, tmp_path) if algo else {}
    with tiny_engine(spec.pop("model_path", model), algo, tree=(3, 2, 5), tp_size=2, **SMALL, **spec) as eng:
        assert eng.debug.kv.window_pool().slots == 102
        assert generate(eng, prompts) == expected


def test_a_slot_costs_the_global_layers_and_a_share_of_the_windowed():
    """Gemma-3-270M's layout (18 layers, every sixth global, window 512; one KV head of 256, bf16): a slot
    costs 3 layers' K/V and --swa-full-tokens-ratio of 15 layers', so the same memory holds more tokens."""
    from transformers import Gemma3TextConfig

    from engine.models.llama import sliding_window

    config = Gemma3TextConfig(num_hidden_layers=18, sliding_window=512, num_key_value_heads=1, head_dim=256)
    layout = SlidingLayout.of([sliding_window(config, i) for i in range(18)], context_length=32768)
    assert layout == SlidingLayout(frozenset(range(18)) - {5, 11, 17}, 512)
    per_layer = KVPool.bytes_per_token(1, 1, 256, torch.bfloat16)
    full, windowed = 3 * per_layer, 15 * per_layer
    assert slot_bytes(full, windowed, 1.0) == 18 * per_layer
    tokens = {ratio: KVBudget.plan(None, 0.5, 8 * 2**30, 2**30, slot_bytes(full, windowed, ratio), 4096).slots
              for ratio in (1.0, 0.8, 0.25)}
    assert tokens[1.0] == (3 * 2**30) // (18 * per_layer)
    assert tokens[0.8] == pytest.approx(tokens[1.0] * 18 / 15, rel=1e-3)
    assert tokens[0.25] == pytest.approx(tokens[1.0] * 18 / 6.75, rel=1e-3)
    # Without windows shorter than the context, nothing changes.
    assert SlidingLayout.of([None, 4096], context_length=4096) is None


def triton_backend(pool):
    pytest.importorskip("triton")
    from engine.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(pool)


@pytest.mark.parametrize("backend", [Gathering, ThroughKernel, triton_backend], ids=["sdpa", "cpu kernel", "triton"])
@pytest.mark.parametrize("window", [3, 12])
def test_backends_read_windowed_layers_through_the_slot_map(backend, window):
    """Decode, prefill pieces, trees and a draft frontier over a window pool: every key's K/V at a shuffled
    window slot, the prefix keys no query of their request reaches freed (mapped to the zero row) and their
    window slots reused by other values. The same attention as over the full pool."""
    requests = [extend(30, 1), tree(20, [-1, 0, 0, 1, 1, 2]), extend(14, 5), draft_frontier(25, 2, 3), extend(0, 4)]
    pool, batch, q, k, v = build(requests, seed=window)
    expected = dense_reference(requests, pool, batch, q, k, v, D_SCALE, window=window)
    perm = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(window)) + 1
    slot_map = torch.cat([torch.zeros(1, dtype=torch.long), perm, torch.tensor([SLOTS + 1])])
    windowed = KVPool(1, SLOTS, HKV, pool.k[0].shape[-1], pool.k[0].dtype, window=WindowPool(frozenset({0}), SLOTS, slot_map))
    windowed.k[0][perm], windowed.v[0][perm] = pool.k[0][1:SLOTS + 1], pool.v[0][1:SLOTS + 1]
    for b, r in enumerate(requests):
        gone = batch.table[b, :max(0, r.prefix - window + 1)]
        windowed.k[0][slot_map[gone]], windowed.v[0][slot_map[gone]] = 1e4, -1e4
        slot_map[gone] = 0
    attention = backend(windowed)
    attention.prepare(batch)
    out = attention.forward(q, k, v, 0, batch, D_SCALE, window=window)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_the_radix_cache_counts_the_window_slots_its_nodes_hold():
    """Nodes whose tokens' window slots were freed give back fewer window slots when evicted: the cache
    counts them through splits and locks, and evicts until both pools have what is asked."""
    alloc = WindowedSlotAllocator(64, 32, WINDOW, "cpu")
    cache = RadixCache(alloc)
    a = alloc.alloc(20)
    alloc.free_window(a[:12])                       # a request's window moved past its first 12 tokens
    # A request may continue after position m when positions m - 7 .. m - 1 hold their window slots.
    assert [alloc.reusable(a[:m]) for m in (20, 19, 18, 15, 3)] == [20, 19, 0, 0, 0]
    cache.insert(list(range(20)), a)
    assert (cache.evictable_size(), cache.evictable_held()) == (20, 8)
    slots, node = cache.match_prefix(list(range(14)))          # splits the node after 14 tokens
    assert alloc.reusable(slots) == 0                          # its window (positions 7..13) partly freed
    cache.inc_lock_ref(node)
    assert (cache.evictable_size(), cache.evictable_held()) == (6, 6)
    cache.dec_lock_ref(node)
    b = alloc.alloc(10)
    cache.insert(list(range(100, 110)), b)
    assert alloc.free_counts() == (64 - 30, 32 - 18) and cache.evictable_held() == 18
    cache.evict(0, 8)       # least recently used first: the 20-token prefix's two nodes (6 and 2 window slots)
    assert alloc.free_counts() == (64 - 10, 32 - 10) and (cache.evictable_size(), cache.evictable_held()) == (10, 10)


def test_a_prefix_locked_alone_frees_its_window_slots_before_the_last_window():
    """Locking frees the window slots a request will not read (before its prefix's last window - 1 tokens)
    on nodes no other request holds: a shorter prefix another request runs on keeps its own."""
    alloc = WindowedSlotAllocator(64, 32, WINDOW, "cpu")
    cache = RadixCache(alloc)
    a = alloc.alloc(30)
    cache.insert(list(range(30)), a)
    _, shorter = cache.match_prefix(list(range(10)))
    cache.inc_lock_ref(shorter)
    _, longer = cache.match_prefix(list(range(30)))
    cache.inc_lock_ref(longer)
    cache.free_window(longer, WINDOW - 1)
    assert [alloc.count_held(a[i:i + 1]) for i in range(30)] == [1] * 10 + [0] * 13 + [1] * 7
    assert alloc.free_counts() == (64 - 30, 32 - 17)
    cache.dec_lock_ref(longer)
    cache.dec_lock_ref(shorter)
    assert (cache.evictable_size(), cache.evictable_held()) == (30, 17)


def test_window_pressure_takes_an_inner_nodes_window_slots_and_keeps_its_full_ones():
    """A shared prefix P with two continuations A and B: asked for window slots, the cache evicts the least
    recently used leaf A whole, then takes P's window slots alone (B is newer): P + B is still reused
    whole, P alone no longer (its last window is gone), and P's full slots stay the cache's."""
    alloc = WindowedSlotAllocator(64, 32, WINDOW, "cpu")
    cache = RadixCache(alloc)
    p, a, b = alloc.alloc(10), alloc.alloc(5), alloc.alloc(10)
    prefix = list(range(10))
    cache.insert(prefix, p)
    cache.insert(prefix + list(range(50, 55)), torch.cat([p, a]))
    cache.insert(prefix + list(range(60, 70)), torch.cat([p, b]))
    assert alloc.free_counts() == (64 - 25, 32 - 25)
    cache.evict(0, 12)
    assert alloc.free_counts() == (64 - 20, 32 - 10)
    assert (cache.evictable_size(), cache.evictable_held()) == (20, 10)
    assert alloc.reusable(cache.match_prefix(prefix + list(range(60, 70)))[0]) == 20
    assert alloc.reusable(cache.match_prefix(prefix)[0]) == 0
    cache.evict(0, 10)                              # B now a leaf of P: whole, then P (no window slots left)
    assert alloc.free_counts() == (64 - 10, 32) and (cache.evictable_size(), cache.evictable_held()) == (10, 0)
    cache.evict(10)
    assert alloc.free_counts() == (64, 32)


def test_a_recomputed_prefix_gives_the_cache_back_its_window_slots():
    """A cached sequence whose window slots were all freed cannot be continued; a request that recomputed
    it (holding its own last window) gives the cache those window slots as it inserts the same tokens,
    then frees its duplicate full slots: the sequence is reusable again."""
    alloc = WindowedSlotAllocator(64, 32, WINDOW, "cpu")
    cache = RadixCache(alloc)
    tokens, cached = list(range(20)), alloc.alloc(20)
    alloc.free_window(cached)
    cache.insert(tokens, cached)
    assert alloc.reusable(cache.match_prefix(tokens)[0]) == 0 and cache.evictable_held() == 0
    again = alloc.alloc(20)
    alloc.free_window(again[:12])                   # its window moved past its first 12 tokens
    assert cache.insert(tokens, again) == 20
    alloc.free(again)
    assert alloc.reusable(cache.match_prefix(tokens)[0]) == 20
    assert cache.evictable_held() == 8 and alloc.free_counts() == (64 - 20, 32 - 8)
