"""NGRAM speculative decoding: drafts are continuations of text already seen, no draft model.

One NgramCache is shared by all requests (as in SGLang): every prompt and every committed output token
teaches it which tokens followed each context of `--speculative-ngram-{min,max}-match-window-size`
tokens. Learning is lazy and incremental: at each draft (and at release) a request's tokens past what
was already learned are added, so per step only the new tokens are touched, and only committed tokens
(never rejected drafts) are ever learned.

Drafting a request's tree:
- Match: the longest suffix of its tokens (max window down to min window) with followers in the cache.
  Nothing matches: the tree is the root alone and the step is a plain decode.
- Breadth, as SGLang's NGRAM sets it: how many children a node may have. A longer match is a more
  specific, more trustworthy context, so the root's breadth falls linearly with the match length, from
  about max_bfs_breadth (a match of min window) to min_bfs_breadth (a match of max window); each level
  deeper has a step less, never under one: step = (max - min breadth) / (max - min window + 1).
  `--speculative-eagle-topk` caps it (children per node, its meaning for EAGLE); left out, it is
  max_bfs_breadth, as in SGLang, and the breadth flags alone shape the tree.
- Expansion, breadth first for up to `steps` levels: a node's candidate children are the followers of
  the longest matching suffix of its own context (the request's tokens plus the path to it), at most
  its breadth of them, most frequent first (most recent among equals). A node scores the empirical
  probability of its path (product of count / total along it); no more nodes than the budget are kept
  per level, since no more can make the cut.
- Cut: the `num_draft_tokens - 1` best-scoring nodes are kept. A child never scores above its parent,
  and is created after it, so the kept set is a tree; a certain (single-follower) continuation keeps
  its parent's score and runs deep, while uncertain branches are dropped first.
Drafts are deterministic: trees carry no draft_probs, and sampling verification treats them as such.
A grammar-constrained request drafts only followers its grammar allows along the path (walked on forks
of its matcher), which verification would otherwise reject anyway.
"""

from __future__ import annotations

import heapq
from operator import itemgetter
from typing import Callable, Optional, Sequence

from engine.config import ServerArgs
from engine.core.grammar import DraftGrammar
from engine.core.request import Request
from engine.speculative.drafter import Drafter
from engine.speculative.ngram_cache import NgramCache
from engine.speculative.tree import DraftTree, TreeBatch
from engine.core.step import DecodeStep


def ngram_tree(cache: NgramCache, context: Sequence[int], steps: int, budget: int,
               breadth: Callable[[int, int], int], grammar: Optional[DraftGrammar] = None) -> DraftTree:
    """A draft tree of at most `budget` nodes besides the root (`context[-1]`) and depth `steps`.
    `breadth(match_length, depth)` gives the children a node at `depth` (the root: 0) may have, for the
    root's match length. With a grammar, followers it refuses are passed over, so the budget goes to
    drafts that can be accepted."""
    root = context[-1]
    ctx = tuple(context[-cache.max_window:])
    root_match, counts = cache.match(ctx)
    if counts is None:
        return DraftTree.chain(root, [])
    tokens, parents, scores = [root], [-1], [1.0]
    # Nodes to expand: (index, context tuple, longest possible match). A context's match is at most one
    # longer than its parent's: a longer one would mean the parent's context matched longer too.
    level = [(0, ctx, root_match)]
    # The `budget`-th best score so far: a node at or below it, created later than the nodes above it,
    # cannot make the cut, nor can its descendants (they score no higher): it is neither kept nor grown.
    floor = 0.0
    for depth in range(steps):
        width = breadth(root_match, depth)
        grown = []
        for node, node_ctx, longest in level:
            match_len, counts = cache.match(node_ctx, longest)
            if counts is None:
                continue
            total = sum(counts.values())
            # Most frequent first; reversed insertion order puts the most recent first among equals.
            ranked = sorted(reversed(counts.items()), key=itemgetter(1), reverse=True)
            best = [(t, c) for t, c in ranked if grammar is None or grammar.allows(node, t)][:width]
            grown += [(scores[node] * (c / total), node, tok, node_ctx, match_len) for tok, c in best]
        # Stable sort: equal scores keep parent order, then follower rank.
        grown = sorted((g for g in grown if g[0] > floor), key=lambda g: -g[0])
        level = []
        for score, parent, tok, parent_ctx, parent_match in grown[:budget]:
            tokens.append(tok)
            parents.append(parent)
            scores.append(score)
            if grammar is not None:
                grammar.grow(len(tokens) - 1, parent, tok)
            level.append((len(tokens) - 1, (parent_ctx + (tok,))[-cache.max_window:], parent_match + 1))
        if len(scores) > budget:
            floor = heapq.nlargest(budget, scores[1:])[-1]
            level = [entry for entry in level if scores[entry[0]] > floor]
        if not level:
            break
    keep = sorted(sorted(range(1, len(tokens)), key=lambda i: (-scores[i], i))[:budget])
    new_index = {0: 0, **{old: new for new, old in enumerate(keep, start=1)}}
    return DraftTree([root] + [tokens[i] for i in keep], [-1] + [new_index[parents[i]] for i in keep])


class NgramDrafter(Drafter):
    def __init__(self, args: ServerArgs, device):
        self.set_tree(args.speculative_tree, False)
        self.device = device
        self.min_window = args.speculative_ngram_min_match_window_size
        self.max_window = args.speculative_ngram_max_match_window_size
        self.min_breadth = args.speculative_ngram_min_bfs_breadth
        self.max_breadth = args.speculative_ngram_max_bfs_breadth
        # Followers kept per context: twice the widest use, so a rising follower can build up a count
        # before it has to compete for a draft slot.
        self.cache = NgramCache(self.min_window, self.max_window, args.speculative_ngram_capacity,
                                2 * self.max_breadth)
        # Tokens of each running request already in the cache, by table row.
        self.learned: dict[int, int] = {}

    def breadth(self, match_len: int, depth: int) -> int:
        step = (self.max_breadth - self.min_breadth) / (self.max_window - self.min_window + 1)
        width = int((self.max_window - match_len - depth) * step + self.min_breadth)
        return min(self.topk, max(1, width))

    def evidence(self, req: Request) -> int:
        """The length of the longest context of the request's text seen before (0: none): drafts from a
        longer match are accepted far more often, and the planner sizes them by it."""
        self._learn(req)
        return self.cache.match(req.token_ids[max(0, req.seq_len - self.max_window):])[0]

    def draft(self, step: DecodeStep) -> TreeBatch:
        for req in step.reqs:                     # all first: one request's text may draft another's
            self._learn(req)
        trees = [ngram_tree(self.cache, req.token_ids[max(0, req.seq_len - self.max_window):], self.steps,
                            budget, self.breadth, None if req.grammar is None else DraftGrammar(req.grammar))
                 if budget else DraftTree.chain(req.token_ids[-1], [])
                 for req, budget in zip(step.reqs, self.budgets(step))]
        return TreeBatch.from_trees(trees, self.device)

    def release(self, req: Request) -> None:
        # Learn the last accepted tokens too, then forget the request. A retracted request that comes
        # back is learned again from its start: its n-grams count twice, which only skews frequencies.
        self._learn(req)
        self.learned.pop(req.row, None)

    def _learn(self, req: Request) -> None:
        done = self.learned.get(req.row, 0)
        if done == req.seq_len:
            return
        start = max(0, done - self.max_window)
        self.cache.learn(req.token_ids[start:], done - start)
        self.learned[req.row] = req.seq_len
