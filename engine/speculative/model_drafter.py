"""ModelDrafter: drafting with a model (STANDALONE, EAGLE, EAGLE-3, MTP), shared by all of them.

The draft keeps its K/V in its own buffers at the target's slots and table rows, so whatever the
target has cached (a radix-shared prefix included) the draft has cached too. Its cache follows the
target's: after every prefill piece and every verification the draft is fed the committed tokens at
their slots ("extend", subclass by subclass), so it never holds a rejected token.

A draft step, for the whole batch at once: the roots' draft scores (`root`), then the EAGLE-2 search
(draft_tree_search), one draft forward per depth. The frontier at depth d sees the cached context, then
its own ancestors drafted at depths 1..d-1, through scratch slots that come with the step (freed by the
scheduler afterwards) and a mask over them: no table row is copied or written.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from engine.core.forward_batch import ForwardBatch, make_batch
from engine.core.request import Request
from engine.core.sampling import SamplingBatch, sample_from_probs
from engine.speculative.draft_tree_search import Draw, search_trees
from engine.speculative.drafter import Drafter
from engine.speculative.tree import TreeBatch
from engine.speculative.verify import sampling_rule
from engine.core.step import DecodeStep
from engine.core.to_device import to_device
from spec_kernels.cpu_keyed_sample import keyed_sample

# Uniform streams for tokens drafted for rejection sampling, apart from verification's (0 for the
# target's keys, 1.. for tree sampling's trials). Coupled drafts draw with stream 0's keys, the target's own.
DRAFT_STREAM = 1000


class ModelDrafter(Drafter):
    # Draft position of the depth-d frontier: kv_len + d + position_shift. EAGLE-style drafts read the
    # token after their position (shift -1); an LLM draft reads its own (0), its root fed into the
    # root's tree slot first, which then precedes every drafted node.
    position_shift = 0
    root_in_kv = False
    leader = None       # tensor parallelism's rank 0 (engine/distributed/mirror.py), when on

    def __init__(self, steps: int, topk: int, num_draft_tokens: int, sampling: str, eos_ids: Sequence[int],
                 table: torch.Tensor):
        self.eos_ids, self.table = list(eos_ids), table
        self.set_tree((steps, topk, num_draft_tokens), sampling)

    def set_tree(self, tree: tuple[int, int, int], sampling: str) -> None:
        super().set_tree(tree, sampling)
        self.scratch_slots = (self.steps - 1) * self.topk     # the frontiers of depths 1 .. steps - 1
        self.sampling = sampling

    # ------------------------------------------------------------------ to implement
    def root(self, step: DecodeStep, roots: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The roots' draft scores [B, V] (target vocabulary) and the state their children read."""
        raise NotImplementedError

    def _feed(self, batch: ForwardBatch, parent_states: Optional[torch.Tensor]) -> torch.Tensor:
        """One draft forward over the batch's new tokens; returns the draft's outputs [T, H]."""
        raise NotImplementedError

    def _scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target vocabulary, -inf where the draft cannot propose."""
        raise NotImplementedError

    # ------------------------------------------------------------------ draft forwards
    # Under tensor parallelism rank 0 announces each draft forward first: every other rank runs the same
    # one on its shard of the draft's weights.
    def feed(self, batch: ForwardBatch, parent_states: Optional[torch.Tensor]) -> torch.Tensor:
        if self.leader is not None:
            return self.leader.feed(self._feed, batch, parent_states)
        return self._feed(batch, parent_states)

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.leader is not None:
            return self.leader.scores(self._scores, hidden)
        return self._scores(hidden)

    # ------------------------------------------------------------------ the draft step
    def draft(self, step: DecodeStep) -> TreeBatch:
        """The trees of the requests with a budget; the others' roots alone, with no draft forward."""
        budgets = self.budgets(step)
        roots = to_device([r.token_ids[-1] for r in step.reqs], self.table.device)
        on = [b for b, k in enumerate(budgets) if k > 0]
        if not on:
            return TreeBatch.roots(roots)
        if len(on) == len(budgets):
            return self._search(step, roots, step.drafts)
        sub = DecodeStep([step.reqs[b] for b in on], step.slots[on], drafts=[budgets[b] for b in on])
        return self._search(sub, roots[to_device(on, roots.device)], sub.drafts).spread(on, roots)

    def _search(self, step: DecodeStep, roots: torch.Tensor, budgets: Optional[Sequence[int]]) -> TreeBatch:
        """EAGLE-2's search for every request of the step (budgets: drafts kept per tree, None: all)."""
        reqs, B, device = step.reqs, len(step.reqs), self.table.device
        rows, prefix = [r.row for r in reqs], [r.kv_len for r in reqs]
        kv_lens = to_device(prefix, device)
        root_scores, root_state = self.root(step, roots)
        scratch = to_device(step.slots[:, self.num_draft_tokens:], device)
        k = min(self.topk, root_scores.shape[-1])
        eye = torch.eye(k, dtype=torch.bool, device=device).expand(B, k, k)
        seen = torch.zeros((B, k, 0), dtype=torch.bool, device=device)     # frontier's drafted ancestors
        states = None if root_state is None else root_state[:, None]

        def expand(depth: int, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
            nonlocal seen, states
            if depth > 1:
                seen = torch.cat([seen.gather(1, parents[:, :, None].expand(-1, -1, seen.shape[2])),
                                  torch.nn.functional.one_hot(parents, k).bool()], dim=2)
            masks, extra = torch.cat([seen, eye], dim=2), scratch[:, :(depth - 1) * k]
            if self.root_in_kv:
                masks = torch.cat([masks.new_ones((B, k, 1)), masks], dim=2)
                extra = torch.cat([step.slots[:, :1].to(device), extra], dim=1)
            positions = (kv_lens + depth + self.position_shift)[:, None].expand(B, k)
            batch = make_batch(self.table, rows, prefix, tokens.flatten(),
                               scratch[:, (depth - 1) * k:depth * k].flatten(), [k] * B,
                               positions=positions.flatten(), extra_slots=extra.flatten(),
                               extra_lens=[extra.shape[1]] * B, masks=masks)
            parent_states = None if states is None else states.gather(
                1, parents[:, :, None].expand(-1, -1, states.shape[2])).flatten(0, 1)
            hidden = self.feed(batch, parent_states)
            states = hidden.view(B, k, -1)
            return self.scores(hidden).view(B, k, -1)

        return search_trees(roots, root_scores, expand, self.steps, self.topk, self.num_draft_tokens,
                            self._draw(reqs) if self.topk == 1 else None, budgets)

    def _draw(self, reqs: Sequence[Request]) -> Optional[Draw]:
        """Sampled requests' chains are drawn from the draft's distribution, processed by their sampling
        parameters (temperature, top-k/p, min-p; penalties without the drafted path: any q keeps the
        rules exact). A coupled request draws with the key the target draws with at the same output
        position, so that a draft close to the target proposes the target's own draw; one checked by
        rejection sampling draws with uniforms of its own. Tree sampling takes the argmax chain."""
        rules = [None if r.params.greedy else sampling_rule(r, self.sampling) for r in reqs]
        if all(rule in (None, "tree") for rule in rules):
            return None
        device = self.table.device
        drew = to_device([rule in ("coupled", "rejection") for rule in rules], device)
        coupled = to_device([rule == "coupled" for rule in rules], device)

        def draw(depth: int, scores: torch.Tensor):
            at = torch.full((len(reqs),), depth - 1, dtype=torch.long, device=device)
            sb = SamplingBatch(reqs, self.eos_ids, device, depth=at)
            q = sb.probs(scores)
            tokens = torch.where(coupled, keyed_sample(q, sb.request_keys(at, 0)),
                                 sample_from_probs(q, sb.request_uniforms(at, DRAFT_STREAM + depth)))
            return tokens, q, drew

        return draw
