import random

import torch

from engine.memory.slots import TokenSlotAllocator
from engine.memory.radix_cache import RadixCache


def make(size=64):
    alloc = TokenSlotAllocator(size)
    return alloc, RadixCache(alloc)


def put(cache, alloc, tokens):
    """Insert tokens with freshly allocated slots, freeing the duplicates as a caller must."""
    slots = alloc.alloc(len(tokens))
    n = cache.insert(tokens, slots)
    alloc.free(slots[:n])
    return slots, n


def cached(cache):
    """Brute-force view of the tree: every cached prefix -> the slot of its last token."""
    out, stack = {}, [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            assert len(child.key) == len(child.value) > 0 and child.parent is node
            for j, slot in enumerate(child.value.tolist()):
                out[path + child.key[:j + 1]] = slot
            stack.append((child, path + child.key))
    return out


def test_match_on_empty_tree():
    _, cache = make()
    slots, node = cache.match_prefix([1, 2, 3])
    assert slots.dtype == torch.int64 and slots.numel() == 0
    assert node is cache.root
    assert cache.match_prefix([])[1] is cache.root
    assert cache.total_size() == 0


def test_insert_then_full_and_partial_match():
    alloc, cache = make()
    slots, n = put(cache, alloc, [5, 6, 7, 8])
    assert n == 0 and cache.total_size() == cache.evictable_size() == 4
    got, node = cache.match_prefix([5, 6, 7, 8])
    assert torch.equal(got, slots) and node.key == (5, 6, 7, 8)
    got, _ = cache.match_prefix([5, 6, 7, 8, 9, 10])
    assert torch.equal(got, slots)
    got, _ = cache.match_prefix([5, 6, 9])
    assert torch.equal(got, slots[:2])
    assert cache.match_prefix([6, 5])[0].numel() == 0


def test_insert_copies_slots():
    alloc, cache = make()
    slots = alloc.alloc(3)
    expected = slots.clone()
    cache.insert([1, 2, 3], slots)
    slots.fill_(0)  # e.g. the request's row being reused
    assert torch.equal(cache.match_prefix([1, 2, 3])[0], expected)


def test_split_in_middle_of_edge_keeps_the_held_node_deepest():
    alloc, cache = make()
    slots, _ = put(cache, alloc, [1, 2, 3, 4, 5])
    _, leaf = cache.match_prefix([1, 2, 3, 4, 5])
    got, mid = cache.match_prefix([1, 2, 3, 9])
    assert torch.equal(got, slots[:3])
    assert mid.key == (1, 2, 3) and mid.parent is cache.root and cache.root.children[1] is mid
    assert list(mid.children.values()) == [leaf] and leaf.key == (4, 5) and leaf.parent is mid
    assert torch.equal(leaf.value, slots[3:])
    got, node = cache.match_prefix([1, 2, 3, 4, 5])
    assert node is leaf and torch.equal(got, slots)
    assert cache.total_size() == 5


def test_insert_returns_duplicated_prefix_count():
    alloc, cache = make()
    first, n = put(cache, alloc, [1, 2, 3])
    assert n == 0
    slots = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], slots) == 3
    # The tree kept its own slots for the shared part and took the new ones for the rest.
    assert torch.equal(cache.match_prefix([1, 2, 3, 4, 5])[0], torch.cat([first, slots[3:]]))
    alloc.free(slots[:3])
    assert cache.insert([1, 2], torch.tensor([60, 61])) == 2
    assert cache.insert([1, 2, 3, 4, 5], torch.tensor([60, 61, 62, 63, 64])) == 5
    assert cache.total_size() == 5
    assert alloc.available() + cache.total_size() == alloc.size


def test_two_branches_share_prefix():
    alloc, cache = make()
    a, _ = put(cache, alloc, [1, 2, 3, 4])
    b, n = put(cache, alloc, [1, 2, 7, 8, 9])
    assert n == 2
    assert cache.total_size() == 7
    shared = cache.root.children[1]
    assert shared.key == (1, 2) and set(shared.children) == {3, 7}
    assert torch.equal(cache.match_prefix([1, 2, 3, 4])[0], a)
    assert torch.equal(cache.match_prefix([1, 2, 7, 8, 9])[0], torch.cat([a[:2], b[2:]]))


def test_lock_protects_node_and_ancestors():
    alloc, cache = make()
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [1, 2, 5, 6])
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 4 and cache.evictable_size() == 2
    before = alloc.available()
    assert cache.evict(100) == 2  # only the unlocked branch [5, 6]
    assert alloc.available() == before + 2
    assert cache.match_prefix([1, 2, 3, 4])[0].numel() == 4
    assert cache.match_prefix([1, 2, 5, 6])[0].numel() == 2
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    assert cache.evict(100) == 4
    assert cache.total_size() == 0 and alloc.available() == alloc.size


def test_lock_survives_a_split():
    alloc, cache = make()
    put(cache, alloc, [1, 2, 3, 4])
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(node)
    put(cache, alloc, [1, 2, 9])  # splits the locked edge
    assert cache.protected_size() == 4 and cache.evictable_size() == 1
    assert node.parent.lock_ref == 1
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 5


def test_evict_lru_first_and_returns_slots():
    alloc, cache = make()
    put(cache, alloc, [1, 2, 3])
    b, _ = put(cache, alloc, [4, 5, 6])
    put(cache, alloc, [7, 8])
    cache.match_prefix([1, 2, 3])  # refresh: [4, 5, 6] is now the oldest
    before = alloc.available()
    assert cache.evict(3) == 3
    assert alloc.available() == before + 3
    assert set(alloc.free_slots()[-3:].tolist()) == set(b.tolist())
    # Checked without matching, which would refresh what it touches.
    assert set(cached(cache)) == {(1,), (1, 2), (1, 2, 3), (7,), (7, 8)}
    assert cache.evict(1) == 2  # [7, 8] is older than the refreshed [1, 2, 3]
    assert set(cached(cache)) == {(1,), (1, 2), (1, 2, 3)}


def test_evict_cascades_to_parents_that_become_leaves():
    alloc, cache = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 4])
    assert cache.evict(2) == 2  # both leaves; [1, 2] is a leaf now but not needed
    assert set(cached(cache)) == {(1,), (1, 2)}
    assert cache.evict(1) == 2  # whole nodes go: asking for 1 frees 2
    assert cache.total_size() == 0 and not cache.root.children
    assert alloc.available() == alloc.size


def test_reset():
    alloc, cache = make()
    put(cache, alloc, [1, 2, 3])
    cache.reset()
    alloc.reset()
    assert cache.total_size() == 0 and cache.match_prefix([1, 2, 3])[0].numel() == 0


def test_freed_slots_are_copied():
    """Freed slots are often a view of a request's table row, which the next request overwrites before
    they are handed out again: the free list must keep their values, not the view."""
    alloc = TokenSlotAllocator(8)
    row = alloc.alloc(8)
    alloc.free(row[2:5])
    row[2:5] = 7
    assert sorted(alloc.alloc(3).tolist()) == [3, 4, 5]


def test_random_ops_against_brute_force():
    rng = random.Random(0)
    alloc, cache = make(size=48)
    model: dict[tuple, int] = {}  # cached prefix -> slot of its last token
    locks: list[tuple] = []  # (node, path) per held lock

    def seq():
        return tuple(rng.randrange(3) for _ in range(rng.randint(1, 8)))

    def model_match(key):
        k = 0
        while k < len(key) and key[:k + 1] in model:
            k += 1
        return k

    for _ in range(300):
        op = rng.random()
        if op < 0.4:  # a request: match, lock, compute the rest, insert, free duplicates, unlock
            key = seq()
            prefix, node = cache.match_prefix(key)
            cache.inc_lock_ref(node)
            new = alloc.alloc(len(key) - len(prefix))
            if new is None:
                cache.evict(len(key) - len(prefix) - alloc.available())
                new = alloc.alloc(len(key) - len(prefix))
            if new is not None:
                n = cache.insert(key, torch.cat([prefix, new]))
                assert n == model_match(key) and n >= len(prefix)
                alloc.free(new[:n - len(prefix)])
                for j in range(n, len(key)):
                    model[key[:j + 1]] = int(new[j - len(prefix)])
            cache.dec_lock_ref(node)
        elif op < 0.6:
            key = seq()
            slots, _ = cache.match_prefix(key)
            k = model_match(key)
            assert slots.tolist() == [model[key[:j + 1]] for j in range(k)]
        elif op < 0.75:
            key = seq()
            slots, node = cache.match_prefix(key)
            if slots.numel():
                cache.inc_lock_ref(node)
                locks.append((node, key[:slots.numel()]))
        elif op < 0.85 and locks:
            node, _ = locks.pop(rng.randrange(len(locks)))
            cache.dec_lock_ref(node)
        else:
            want = rng.randint(1, 20)
            evictable, available = cache.evictable_size(), alloc.available()
            freed = cache.evict(want)
            assert min(want, evictable) <= freed <= evictable
            assert alloc.available() == available + freed
            after = cached(cache)
            assert len(after) == len(model) - freed
            assert all(model[p] == s for p, s in after.items())
            model = after

        # Invariants: the tree holds exactly the model; sizes match a walk over locked paths;
        # every slot is in the allocator or in one node, never both, never lost.
        assert cached(cache) == model
        protected = {path[:j] for _, path in locks for j in range(1, len(path) + 1)}
        assert cache.protected_size() == len(protected)
        assert cache.evictable_size() == len(model) - len(protected)
        assert cache.total_size() == len(model)
        slots = alloc.free_slots().tolist() + list(model.values())
        assert sorted(slots) == list(range(1, alloc.size + 1))

    for node, _ in locks:
        cache.dec_lock_ref(node)
    assert cache.protected_size() == 0
    assert cache.evict(alloc.size) == len(model)
    assert alloc.available() == alloc.size
