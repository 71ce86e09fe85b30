"""Verification rules in isolation, on whole batches at once: greedy walks, chi-square proofs that
tree sampling and rejection sampling reproduce the target distribution exactly, whatever the draft, and
that the coupled rule reproduces plain decoding's keyed draws token for token.
Each sample is one request of a batch (its own seed), so one call verifies thousands of trees."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare

from engine.core.sampling import SamplingBatch, keys
from engine.core.sampling_params import SamplingParams
from engine.speculative.tree import DraftTree, TreeBatch
from engine.speculative.verify import verify
from spec_kernels.cpu_keyed_sample import keyed_sample

V = 4
SAMPLES = 10000


def run_verify(trees: list[DraftTree], probs: list[torch.Tensor], *, draft_probs=None, rule="tree",
               temperature=1.0) -> list[tuple[list[int], int]]:
    """(accepted node indices, bonus) per tree; probs[b]: the target's distribution after each node."""
    batch = TreeBatch.from_trees(trees, "cpu")
    if draft_probs is not None:
        batch.draft_probs = draft_probs
    params = SamplingParams(temperature=temperature)
    reqs = [SimpleNamespace(params=params, token_ids=[1], prompt_len=1, seed=i) for i in range(len(trees))]
    sb = SamplingBatch(reqs, [], "cpu", rows_per_req=batch.sizes, depth=batch.depth[batch.valid])
    acc = verify(batch, torch.cat(probs).log(), sb, [rule] * len(trees))
    return [(idx[:n], bonus) for idx, n, bonus in zip(acc.index.tolist(), acc.length.tolist(), acc.bonus.tolist())]


def test_tree_batch_structure():
    tree = TreeBatch.from_trees([DraftTree([9, 1, 2, 3, 4], [-1, 0, 0, 1, 1]), DraftTree.chain(5, [6])], "cpu")
    assert tree.depth[0].tolist() == [0, 1, 1, 2, 2] and tree.sizes == [5, 2]
    assert tree.ancestors[0, 3].tolist() == [True, True, False, True, False]
    assert tree.ancestors[0, 2].tolist() == [True, False, True, False, False]
    assert tree.valid[1].tolist() == [True, True, False, False, False]
    assert (tree.max_depth, tree.max_children, tree.is_chain) == (2, 2, False)
    assert not DraftTree([9, 1, 2], [-1, 0, 0]).is_chain and DraftTree.chain(9, [1, 2]).is_chain


def test_greedy_follows_argmax_and_returns_bonus():
    tree = DraftTree([9, 1, 2, 3, 4], [-1, 0, 0, 1, 1])
    # root wants 1 (node 1), node 1 wants 4 (node 4), node 4 wants 2; in the second tree the root wants 3.
    wants = [[1, 4, 0, 0, 2], [3, 0, 0, 0, 0]]
    probs = [torch.nn.functional.one_hot(torch.tensor(w), 5).float() * 0.9 + 0.02 for w in wants]
    assert run_verify([tree, tree], probs, temperature=0) == [([0, 1, 4], 2), ([0], 3)]


def _dirichlet(n):
    return torch.distributions.Dirichlet(torch.ones(V)).sample((n,))


def _joint_test(observed: dict, expected: torch.Tensor) -> float:
    obs = torch.tensor([observed.get((a, b), 0) for a in range(V) for b in range(V)], dtype=torch.float64)
    exp = expected.flatten().double()
    keep = exp > 0
    assert obs[~keep].sum() == 0, "a zero-probability sequence came out"
    exp = exp[keep] / exp[keep].sum() * obs.sum()
    return chisquare(obs[keep], exp).pvalue


def _first_two(tree: DraftTree, path: list[int], bonus: int, p_after: torch.Tensor, gen) -> tuple[int, int]:
    out = [tree.tokens[i] for i in path[1:]] + [bonus]
    if len(out) < 2:
        # The first token is not a tree node: its successor comes from the next step, i.e. from p_after.
        out.append(int(torch.multinomial(p_after[out[0]], 1, generator=gen)))
    return out[0], out[1]


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 1], [2]])
def test_tree_sampling_is_exact(order):
    """Root children `order` (a partial tree too), each with one child; joint of the first two output
    tokens must be p_root(a) * p_a(b), with p_a the target's distribution after token a."""
    torch.manual_seed(0)
    p_root, p_after = _dirichlet(1)[0], _dirichlet(V)          # p_after[a]: target after first token a
    tokens, parents, node_of = [7], [-1], {}
    for a in order:
        node_of[a] = len(tokens)
        tokens.append(a)
        parents.append(0)
    for a in order:
        tokens.append((a + 1) % V)
        parents.append(node_of[a])
    tree = DraftTree(tokens, parents)
    probs = torch.full((len(tree), V), 1.0 / V)
    probs[0] = p_root
    for a in order:
        probs[node_of[a]] = p_after[a]
    gen = torch.Generator().manual_seed(2)
    counts: dict = {}
    for path, bonus in run_verify([tree] * SAMPLES, [probs] * SAMPLES):
        key = _first_two(tree, path, bonus, p_after, gen)
        counts[key] = counts.get(key, 0) + 1
    assert _joint_test(counts, p_root[:, None] * p_after) > 0.001


def test_rejection_sampling_is_exact():
    """Chains of two drafts drawn from the draft distributions q; the output follows the target p."""
    torch.manual_seed(1)
    p_root, p_after = _dirichlet(1)[0], _dirichlet(V)
    q_root, q_after = _dirichlet(1)[0], _dirichlet(V)
    gen = torch.Generator().manual_seed(3)
    d1 = torch.multinomial(q_root, SAMPLES, replacement=True, generator=gen)
    d2 = torch.stack([torch.multinomial(q_after[a], 1, generator=gen)[0] for a in d1.tolist()])
    trees = [DraftTree.chain(7, [a, b]) for a, b in zip(d1.tolist(), d2.tolist())]
    q = torch.stack([torch.zeros(SAMPLES, V), q_root.expand(SAMPLES, V), q_after[d1]], 1)
    probs = [torch.stack([p_root, p_after[a], torch.full((V,), 1.0 / V)]) for a in d1.tolist()]
    counts: dict = {}
    for tree, (path, bonus) in zip(trees, run_verify(trees, probs, draft_probs=q, rule="rejection")):
        key = _first_two(tree, path, bonus, p_after, gen)
        counts[key] = counts.get(key, 0) + 1
    assert _joint_test(counts, p_root[:, None] * p_after) > 0.001


def test_rejection_accepts_more_than_tree_sampling_for_a_good_sampled_draft():
    """With a sampled draft close to the target, min(1, p/q) accepts nearly always; treating the same
    draft as deterministic accepts only with probability p(token)."""
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    d = torch.multinomial(p, 4000, replacement=True, generator=torch.Generator().manual_seed(5)).tolist()
    trees = [DraftTree.chain(7, [t]) for t in d]
    probs = [torch.stack([p, p])] * len(trees)
    q = torch.stack([torch.zeros(len(d), V), p.expand(len(d), V)], 1)
    rejection = sum(len(path) - 1 for path, _ in run_verify(trees, probs, draft_probs=q, rule="rejection"))
    tree_sampling = sum(len(path) - 1 for path, _ in run_verify(trees, probs))
    assert rejection > 3900 and tree_sampling < 0.4 * 4000


def test_coupled_rule_emits_plain_decodings_draws():
    """Whatever the tree, the coupled rule's output is the keyed draw at each output position from the
    target's distribution after the tokens before it: what plain decoding draws there, step by step."""
    torch.manual_seed(4)
    n = 2000
    p_root, p_after = _dirichlet(1)[0], _dirichlet(V)
    tokens, parents = [7, 0, 1, 2, 3], [-1, 0, 0, 0, 0]           # every first token drafted, no deeper node
    tokens += [1, 2]
    parents += [1, 2]
    tree = DraftTree(tokens, parents)
    probs = torch.full((len(tree), V), 1.0 / V)
    probs[0] = p_root
    for node in range(1, 5):
        probs[node] = p_after[tokens[node]]
    outputs = run_verify([tree] * n, [probs] * n, rule="coupled")
    seeds = torch.arange(n)
    first = keyed_sample(p_root.expand(n, V).contiguous(), keys(seeds, torch.zeros(n, dtype=torch.long), 0))
    second = keyed_sample(p_after[first].contiguous(), keys(seeds, torch.ones(n, dtype=torch.long), 0))
    accepted = 0
    for (path, bonus), a, b in zip(outputs, first.tolist(), second.tolist()):
        out = [tokens[i] for i in path[1:]] + [bonus]
        assert out[0] == a                              # every first token is drafted: always accepted
        if len(out) > 1:
            assert out[1] == b
        accepted += len(path) - 1
    assert accepted > n                                 # second tokens were accepted too


def test_coupled_rule_accepts_a_draft_sampled_with_the_same_keys():
    """A draft that samples its own distribution q with the target's keys proposes the target's draw
    whenever q = p, and often when q is close: coupling, not luck, makes sampled drafts pay."""
    n = 4000
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    q_close = torch.tensor([0.35, 0.35, 0.2, 0.1])
    seeds = torch.arange(n)
    k = keys(seeds, torch.zeros(n, dtype=torch.long), 0)
    for q, least in ((p, n), (q_close, 0.85 * n)):
        drafts = keyed_sample(q.expand(n, V).contiguous(), k).tolist()
        trees = [DraftTree.chain(7, [t]) for t in drafts]
        got = sum(len(path) - 1 for path, _ in run_verify(trees, [torch.stack([p, p])] * n, rule="coupled"))
        assert got >= least
