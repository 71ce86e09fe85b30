"""EAGLE (EAGLE-1/2) and EAGLE-3 speculative decoding: a one-layer draft reads the target's features.

At position t the draft takes (token x_{t+1}, feature f_t): f_t is the target's hidden state at t
(EAGLE: the final normed one; EAGLE-3: fc over three captured ones) for committed tokens, and the
draft's own output for drafted ones. Its output at t gives the distribution of x_{t+2}.

The draft has its own one-layer KV pool, slot allocator and req-to-token table (as many tokens as the
target's pool, plus scratch), used through the same attention backend. Per request it keeps the
target features not yet fed (`pending`) and its cached length; its cache holds committed positions
only. Features arrive
- after each prefill chunk: the chunk's rows of the target forward; the draft is fed them at once
  (the next token of every position is known by then, the first sampled one included), so its
  "prefill" is chunked like the target's;
- after each verification: the rows of the accepted path (root, accepted drafts), fed by the next
  draft() whose input tokens (the accepted drafts and the bonus) are appended by then.
A draft step feeds what is pending (catch-up), takes the last position's output as the root's state,
then grows the tree with the shared EAGLE-2 search (draft_tree_search): a chain of argmax (or, for
requests verified by rejection sampling, sampled) tokens for topk 1. Drafted nodes use scratch slots
and rows: each of a request's topk branches has a table row holding the committed slots followed by
its path's, so a node attends to the committed context and its own ancestors only. Scratch is freed
after drafting, so rejected tokens never reach the draft cache.
A request whose features are missing or that the draft pool cannot hold drafts
nothing and decodes plainly; the next verification's features restart its draft context there. So
does a prefix served from the radix cache: the target computes no features for it, and the draft's
context starts after it.
MTP runs the same way with a multi-token-prediction layer as the draft (engine/models/mtp.py): the
target's own, or a separate nextn checkpoint's given as the draft path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from engine.attention import create_backend
from engine.config import ServerArgs
from engine.forward_batch import build_forward_batch
from engine.loader import resolve_model_path
from engine.memory.kv_pool import KVPool, ReqToTokenPool, TokenSlotAllocator
from engine.model_runner import ForwardItem, ForwardOutput, ModelRunner
from engine.models.eagle import load_eagle_draft
from engine.models.mtp import load_mtp_draft
from engine.request import Request
from engine.speculative.base import SpeculativeWorker, Verified
from engine.speculative.draft_tree_search import Frontier, chain_samplers, search_trees
from engine.speculative.token_map import load_token_map
from engine.speculative.tree import DraftTree

log = logging.getLogger(__name__)


@dataclass
class _DraftState:
    row: int                      # row of the draft's req-to-token table
    start: int                    # position of the first cached entry (where the target's features began)
    kv_len: int = 0               # positions start .. start + kv_len - 1 are cached
    pending: list[torch.Tensor] = field(default_factory=list)   # features of the next positions, unfed
    last: Optional[torch.Tensor] = None                        # output at the last cached position [H]

    @property
    def pending_len(self) -> int:
        return sum(f.shape[0] for f in self.pending)


class EagleWorker(SpeculativeWorker):
    def __init__(self, runner: ModelRunner, eos_ids: Sequence[int], args: ServerArgs):
        super().__init__(runner, eos_ids, args)
        algorithm = args.speculative_algorithm
        hot = None
        if args.speculative_token_map:
            if algorithm == "EAGLE3":
                log.warning("--speculative-token-map is ignored with EAGLE3: its draft has its own reduced "
                            "vocabulary (d2t).")
            else:
                hot = load_token_map(args.speculative_token_map, runner.config.vocab_size)
        self.target = runner.model
        kw = dict(max_positions=runner.context_len + 64 + self.steps, dtype=runner.dtype, device=runner.device,
                  hot_ids=hot)
        # Without a draft path (MTP only: the flags require one for EAGLE/EAGLE3) the draft is the target's
        # own MTP layer; the runner does not keep its directory, so resolve its argument again.
        own = not args.speculative_draft_model_path
        draft_dir = (runner.model_dir if own else
                     resolve_model_path(args.speculative_draft_model_path, args.speculative_draft_model_revision))
        if algorithm == "MTP":
            self.model = load_mtp_draft(draft_dir, runner.model, own=own, **kw)
        else:
            self.model = load_eagle_draft(algorithm, draft_dir, runner.model, **kw)
        self.capture_hidden = self.model.aux_layers
        attn = self.model.attention
        # Rows: one per running (or chunk-prefilling) request plus topk - 1 scratch rows each while
        # drafting. Slots: committed positions never exceed the target's, plus each row's scratch path.
        rows = runner.max_requests * self.topk + 8
        tokens = runner.allocator.size + rows * self.steps
        self.kv_pool = KVPool(1, tokens, attn.num_kv_heads, attn.head_dim, runner.dtype, runner.device)
        self.allocator = TokenSlotAllocator(tokens)
        self.req_to_token = ReqToTokenPool(rows, runner.req_to_token.table.shape[1], runner.device)
        self.backend = create_backend(args.attention_backend, runner.device, self.kv_pool, self.req_to_token)
        self.states: dict[Request, _DraftState] = {}
        log.info("%s draft %s: aux hidden states %s, draft KV pool %d tokens", algorithm, draft_dir,
                 self.capture_hidden or "none", tokens)

    # ------------------------------------------------------------------ features in
    def after_prefill(self, plan: Sequence[tuple[Request, int]], out: ForwardOutput) -> None:
        offset, fed = 0, []
        with torch.inference_mode():
            for req, n in plan:
                if not req.finished:
                    state = self.states.get(req)
                    if state is None:
                        state = self.states[req] = _DraftState(self.req_to_token.alloc(), req.kv_len - n)
                    state.pending.append(self.model.target_features(out.hidden, out.captured, slice(offset, offset + n)))
                    fed.append(req)
                offset += n
            self._catch_up(fed)

    def after_verify(self, reqs: Sequence[Request], results: list[Verified], out: ForwardOutput) -> None:
        with torch.inference_mode():
            for req, res in zip(reqs, results):
                state = self.states.get(req)
                if state is None:           # restart the draft context at this step's root
                    state = self.states[req] = _DraftState(self.req_to_token.alloc(), req.kv_len - len(res.path))
                rows = torch.tensor(res.path, device=out.hidden.device) + res.hidden_offset
                state.pending.append(self.model.target_features(out.hidden, out.captured, rows))

    def release(self, req: Request) -> None:
        state = self.states.pop(req, None)
        if state is not None:
            # .cpu(): the table may live on the GPU, the allocator's free list lives on the CPU.
            self.allocator.free(self.req_to_token.table[state.row, :state.kv_len].cpu())
            self.req_to_token.free(state.row)

    # ------------------------------------------------------------------ drafting
    def draft(self, reqs: Sequence[Request]) -> list[DraftTree]:
        trees = [DraftTree.chain(r.all_ids[-1], []) for r in reqs]
        with torch.inference_mode():
            self._catch_up([r for r in reqs if r in self.states])
            ready = self._admit(reqs)
            if ready:
                drafting = [reqs[i] for i in ready]
                for i, tree in zip(ready, self._search(drafting)):
                    trees[i] = tree
        return trees

    def _admit(self, reqs: Sequence[Request]) -> list[int]:
        """Indices of the requests with a draft state whose scratch path fits in the draft pool now."""
        free, need = self.allocator.available(), (self.steps - 1) * self.topk
        ready = []
        for i, req in enumerate(reqs):
            state = self.states.get(req)
            if state is not None and state.last is not None and not state.pending and need <= free:
                free -= need
                ready.append(i)
        return ready

    def _catch_up(self, reqs: Sequence[Request]) -> None:
        """Feed every pending (next token, feature) pair of these requests in one draft forward; the
        tokens are shifted by one: position t's input token is x_{t+1}."""
        items, features, fed = [], [], []
        free = self.allocator.available()
        for req in reqs:
            state = self.states[req]
            n = state.pending_len
            if n == 0:
                continue
            if n > free:                     # no room: forget this context, restart after a verification
                self.release(req)
                continue
            free -= n
            pos = state.start + state.kv_len
            items.append(ForwardItem(state.row, state.kv_len, req.all_ids[pos + 1:pos + 1 + n], range(pos, pos + n)))
            features.append(torch.cat(state.pending))
            fed.append(state)
        if not items:
            return
        hidden, _ = self._forward(items, torch.cat(features))
        offset = 0
        for state, item in zip(fed, items):
            n = len(item.token_ids)
            offset += n
            state.kv_len += n
            state.pending = []
            state.last = hidden[offset - 1].clone()     # not a view: the forward's outputs can go

    def _search(self, reqs: list[Request]) -> list[DraftTree]:
        states = [self.states[r] for r in reqs]
        rows = self._branch_rows(states)
        table = self.req_to_token.table
        # Per request, the outputs of the last expanded nodes (at first: the root's state).
        parent_hidden = [s.last[None] for s in states]
        scratch: list[torch.Tensor] = []

        def expand(frontiers: list[Frontier]) -> torch.Tensor:
            items, inputs, sizes = [], [], []
            for req, state, branch_rows, f, parents in zip(reqs, states, rows, frontiers, parent_hidden):
                start, depth = state.kv_len, f.depth
                if depth > 1:
                    # Each node's path: its parent's path, whose last slot the parent's forward wrote.
                    paths = table[torch.tensor([branch_rows[p] for p in f.parents]), start:start + depth - 1]
                    table[torch.tensor(branch_rows[:len(f.parents)]), start:start + depth - 1] = paths
                pos = req.kv_len - 1 + depth
                items += [ForwardItem(row, start + depth - 1, [tok], [pos]) for row, tok in zip(branch_rows, f.tokens)]
                inputs.append(parents[torch.tensor([max(p, 0) for p in f.parents])])
                sizes.append(len(f.tokens))
            hidden, slots = self._forward(items, torch.cat(inputs))
            scratch.append(slots)
            parent_hidden[:] = hidden.split(sizes)
            return self.model.logits(hidden)

        samplers = chain_samplers(reqs, self.eos_ids, self.topk == 1 and self.use_rejection)
        root_scores = self.model.logits(torch.stack([s.last for s in states]))
        trees = search_trees([r.all_ids[-1] for r in reqs], root_scores, expand, self.steps, self.topk,
                             self.num_draft_tokens, samplers)
        for slots in scratch:
            self.allocator.free(slots)
        for branch_rows in rows:
            for row in branch_rows[1:]:
                self.req_to_token.free(row)
        return trees

    def _branch_rows(self, states: list[_DraftState]) -> list[list[int]]:
        """Per request, topk table rows starting with its cached entries: its own and scratch copies."""
        table = self.req_to_token.table
        rows = []
        for state in states:
            scratch = [self.req_to_token.alloc() for _ in range(self.topk - 1)]
            table[scratch, :state.kv_len] = table[state.row, :state.kv_len]
            rows.append([state.row] + scratch)
        return rows

    def _forward(self, items: list[ForwardItem], features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward: each item's tokens (with explicit positions) after its cached entries, fed
        with `features` row by row. Returns (outputs [T, H], the new entries' KV slots)."""
        slots = self.allocator.alloc(sum(len(it.token_ids) for it in items))
        assert slots is not None, "callers check the draft pool's free slots"
        batch = build_forward_batch(items, slots, self.req_to_token.table)
        self.backend.prepare(batch)
        embeds = self.target.embed(batch.input_ids)
        return self.model(embeds, features, batch.positions, batch, self.backend), slots
