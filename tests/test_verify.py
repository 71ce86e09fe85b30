"""Verification rules in isolation: greedy walks, and chi-square proofs that tree sampling and rejection
sampling reproduce the target distribution exactly, whatever the draft."""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare

from engine.speculative.tree import DraftTree
from engine.speculative.verify import verify_greedy, verify_rejection, verify_tree_sampling

V = 4
SAMPLES = 10000


def test_tree_structure_and_mask():
    tree = DraftTree([9, 1, 2, 3, 4], [-1, 0, 0, 1, 1])
    assert tree.depths == [0, 1, 1, 2, 2]
    assert tree.children == [[1, 2], [3, 4], [], [], []]
    m = tree.mask()
    assert m[3].tolist() == [True, True, False, True, False]
    assert m[2].tolist() == [True, False, True, False, False]
    assert tree.path_to(4) == [0, 1, 4] and not tree.is_chain
    assert DraftTree.chain(9, [1, 2]).is_chain


def test_from_paths_merges_prefixes_and_respects_limit():
    tree = DraftTree.from_paths(0, [[5, 6, 7], [5, 8], [9]], limit=5)
    assert tree.tokens == [0, 5, 6, 7, 8] and tree.parents == [-1, 0, 1, 2, 1]


def test_greedy_follows_argmax_and_returns_bonus():
    tree = DraftTree([9, 1, 2, 3, 4], [-1, 0, 0, 1, 1])
    argmax = [1, 4, 0, 0, 2]       # root wants 1 (node 1), node 1 wants 4 (node 4), node 4 wants 2
    assert verify_greedy(tree, argmax) == ([0, 1, 4], 2)
    assert verify_greedy(tree, [3, 0, 0, 0, 0]) == ([0], 3)


def _dirichlet(gen, n):
    return torch.distributions.Dirichlet(torch.ones(V)).sample((n,))


def _joint_test(observed: dict, expected: torch.Tensor) -> float:
    obs = torch.tensor([observed.get((a, b), 0) for a in range(V) for b in range(V)], dtype=torch.float64)
    exp = expected.flatten().double()
    keep = exp > 0
    assert obs[~keep].sum() == 0, "a zero-probability sequence came out"
    exp = exp[keep] / exp[keep].sum() * obs.sum()
    return chisquare(obs[keep], exp).pvalue


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 1], [2]])
def test_tree_sampling_is_exact(order):
    """Root children `order` (a partial tree too), each with one child; joint of the first two output
    tokens must be p_root(a) * p_a(b), with p_a the target's distribution after token a."""
    torch.manual_seed(0)
    p_root = _dirichlet(None, 1)[0]
    p_after = _dirichlet(None, V)                       # p_after[a]: target after first token a
    grandchild = {a: (a + 1) % V for a in order}
    tokens, parents = [7], [-1]
    node_of = {}
    for a in order:
        node_of[a] = len(tokens)
        tokens.append(a)
        parents.append(0)
    for a in order:
        tokens.append(grandchild[a])
        parents.append(node_of[a])
    tree = DraftTree(tokens, parents)
    probs = torch.zeros(len(tree), V)
    probs[0] = p_root
    for a in order:
        probs[node_of[a]] = p_after[a]
    for i in range(len(order) + 1, len(tree)):
        probs[i] = torch.full((V,), 1.0 / V)
    rng = random.Random(1)
    counts: dict = {}
    second_needed = 0
    for _ in range(SAMPLES):
        path, bonus = verify_tree_sampling(tree, probs, lambda d, s: rng.random())
        out = [tree.tokens[i] for i in path[1:]] + [bonus]
        if len(out) < 2:
            # The first token is not a tree node: its successor comes from the next step, i.e. from p_after.
            out.append(int(torch.multinomial(p_after[out[0]], 1)))
            second_needed += 1
        counts[(out[0], out[1])] = counts.get((out[0], out[1]), 0) + 1
    expected = p_root[:, None] * p_after
    assert _joint_test(counts, expected) > 0.001


def test_rejection_sampling_is_exact():
    """Chain of two drafts drawn from the draft distributions q; output follows the target p."""
    torch.manual_seed(1)
    p_root, p_after = _dirichlet(None, 1)[0], _dirichlet(None, V)
    q_root, q_after = _dirichlet(None, 1)[0], _dirichlet(None, V)
    rng = random.Random(2)
    gen = torch.Generator().manual_seed(3)
    counts: dict = {}
    for _ in range(SAMPLES):
        d1 = int(torch.multinomial(q_root, 1, generator=gen))
        d2 = int(torch.multinomial(q_after[d1], 1, generator=gen))
        tree = DraftTree.chain(7, [d1, d2], torch.stack([q_root, q_after[d1]]))
        probs = torch.stack([p_root, p_after[d1], torch.full((V,), 1.0 / V)])
        path, bonus = verify_rejection(tree, probs, lambda d, s: rng.random())
        out = [tree.tokens[i] for i in path[1:]] + [bonus]
        if len(out) < 2:
            out.append(int(torch.multinomial(p_after[out[0]], 1, generator=gen)))
        counts[(out[0], out[1])] = counts.get((out[0], out[1]), 0) + 1
    assert _joint_test(counts, p_root[:, None] * p_after) > 0.001


def test_rejection_accepts_more_than_tree_sampling_for_a_good_sampled_draft():
    """With a sampled draft close to the target, min(1, p/q) accepts nearly always; treating the same
    draft as deterministic accepts only with probability p(token)."""
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    rng = random.Random(4)
    gen = torch.Generator().manual_seed(5)
    rej = tree_acc = 0
    for _ in range(4000):
        d = int(torch.multinomial(p, 1, generator=gen))
        chain = DraftTree.chain(7, [d], p[None])
        probs = torch.stack([p, p])
        rej += len(verify_rejection(chain, probs, lambda a, s: rng.random())[0]) - 1
        tree_acc += len(verify_tree_sampling(DraftTree.chain(7, [d]), probs, lambda a, s: rng.random())[0]) - 1
    assert rej > 3900 and tree_acc < 0.4 * 4000
