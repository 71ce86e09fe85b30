"""Worker: runs one step's forwards, for both phases and every algorithm, and says what came out.

Prefill: one target forward over the prompt pieces; the first output token of each completed prompt
is sampled on the device. Decode: the drafter's trees (root-only trees without a drafter: plain decoding
is the verification of an empty draft), one target forward over every node under the tree masks,
acceptance on the device (speculative/verify.py), then the drafter's catch-up on what was accepted.
One host synchronisation per step: the tokens that come out and how many were accepted.

The worker changes no request and allocates nothing: the step's KV slots come with it, and the
scheduler applies the StepResult (appends tokens, commits the accepted slots, frees the rest).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from engine.core.forward_batch import make_batch
from engine.core.model_runner import ForwardOutput, ModelRunner
from engine.core.grammar import row_bitmask
from engine.core.sampling import PathTokens, SamplingBatch, unpack_logprobs
from engine.speculative.drafter import Drafter
from engine.speculative.tree import TreeBatch
from engine.speculative.verify import sampling_rule, verify
from engine.core.step import DecodeStep, PrefillStep, StepResult
from engine.core.to_device import ragged_index, to_device
from spec_kernels import cpu_argmax


class Worker:
    def __init__(self, target: ModelRunner, table: torch.Tensor, eos_ids: Sequence[int],
                 drafter: Optional[Drafter] = None, num_draft_tokens: int = 1, sampling: str = "coupled",
                 tree_as_decode: bool = False):
        self.target, self.table, self.eos_ids = target, table, list(eos_ids)
        # sampling: the verification rule of sampled requests that gave no seed (speculative/verify.py).
        self.drafter, self.num_draft_tokens, self.sampling = drafter, num_draft_tokens, sampling
        # --speculative-attention-mode decode: every tree node is a decode row of its own.
        self.tree_as_decode = tree_as_decode
        self.capture: tuple[int, ...] = ()          # hidden states to return per request (Request.captured)

    @property
    def slots_per_request(self) -> int:
        """KV slots one request may use in a decode step: a tree's, plus the drafter's scratch."""
        return self.num_draft_tokens + (self.drafter.scratch_slots if self.drafter else 0)

    @property
    def capture_hidden(self) -> tuple[int, ...]:
        """Hidden states every forward returns: those asked for, and those the drafter reads."""
        return tuple(sorted(set(self.capture) | set(self.drafter.capture_hidden if self.drafter else ())))

    def forward(self, step) -> StepResult:
        with torch.inference_mode():
            return self._prefill(step) if isinstance(step, PrefillStep) else self._decode(step)

    def release(self, req) -> None:
        if self.drafter:
            self.drafter.release(req)

    # ------------------------------------------------------------------ prefill
    def _prefill(self, step: PrefillStep) -> StepResult:
        reqs, lens = step.reqs, step.lens
        batch = make_batch(self.table, [r.row for r in reqs], [r.kv_len for r in reqs], step.input_ids(), step.slots,
                           lens, capture_hidden=self.capture_hidden)
        done = [i for i in range(len(reqs)) if step.completes(i)]
        ends = torch.tensor(lens).cumsum(0) - 1
        out = self.target.forward(batch, ends[done].to(self.table.device))
        first: list[int] = []
        logprobs = None
        if done:
            finishing = [reqs[i] for i in done]
            sb = SamplingBatch(finishing, self.eos_ids, self.table.device,
                               bitmask=row_bitmask(finishing, [1] * len(done), out.logits.shape[-1]))
            ids = sb.sample(out.logits)
            rows = torch.arange(len(done), device=ids.device)[:, None]
            ints, floats = _to_host(ids[:, None], _logprobs(sb, out.logits, finishing, rows, ids[:, None]))
            first = [h[0] for h in ints]
            if floats is not None:
                per_done = dict(zip(done, _unpack(finishing, floats, [1] * len(done), 1)))
                logprobs = [per_done.get(i) for i in range(len(reqs))]
        sampled = dict(zip(done, first))
        next_tokens = [sampled[i] if i in sampled else r.token_ids[r.kv_len + n] for i, (r, n) in enumerate(zip(reqs, lens))]
        if self.drafter:
            self.drafter.after_prefill(step, out, next_tokens)
        captured = None
        if self.capture:
            argmax = torch.full((int(ends[-1]) + 1,), -1, dtype=torch.long, device=out.hidden.device)
            if done:
                argmax[ends[done].to(argmax.device)] = cpu_argmax.argmax(out.logits)
            captured = self._captured(out, torch.arange(len(argmax), device=argmax.device), lens, reqs, argmax)
        return StepResult([[sampled[i]] if i in sampled else [] for i in range(len(reqs))], list(lens), captured=captured,
                          logprobs=logprobs)

    # ------------------------------------------------------------------ decode
    def _decode(self, step: DecodeStep) -> StepResult:
        reqs, device = step.reqs, self.table.device
        start = time.perf_counter()
        tree = (self.drafter.draft(self._drafter_view(step)) if self.drafter else
                TreeBatch.roots(to_device([r.token_ids[-1] for r in reqs], device)))
        drafting = time.perf_counter() - start
        own = list(tree.sizes)              # the drafter's nodes; a prediction chain's come after them
        if step.chain_slots:
            tree = tree.with_chains(step.chains)
        # The trees' nodes, request after request.
        nodes = None if all(n == tree.width for n in tree.sizes) else ragged_index(tree.sizes, tree.width, device)

        def flat(x: torch.Tensor) -> torch.Tensor:
            return x.flatten(0, 1) if nodes is None else x.flatten(0, 1)[nodes]

        depth = tree.depth
        kv = to_device([r.kv_len for r in reqs], device)
        slots = to_device(step.slots, device)
        if self.tree_as_decode and tree.width > 1:
            batch = self._nodes_as_decode_rows(reqs, tree, slots)
        else:
            batch = make_batch(self.table, [r.row for r in reqs], [r.kv_len for r in reqs],
                               flat(tree.tokens), flat(slots[:, :tree.width]), tree.sizes,
                               positions=flat(kv[:, None] + depth), masks=None if tree.is_chain else tree.ancestors,
                               capture_hidden=self.capture_hidden)
        # Grammar masks are walked on the host along the trees: a host copy of the drafted trees, in
        # steps with a constrained request only, taken before the forward so that the walk overlaps it.
        grammar_trees = (tree.tokens.tolist(), tree.parents.tolist()) if tree.width > 1 and any(
            r.grammar is not None for r in reqs) else (None, None)
        out = self.target.forward(batch, all_logits=True, decode=True)
        sb = SamplingBatch(reqs, self.eos_ids, device, rows_per_req=tree.sizes, depth=flat(depth),
                           paths=PathTokens(tree.ancestors, tree.tokens) if tree.width > 1 else None,
                           bitmask=row_bitmask(reqs, tree.sizes, out.logits.shape[-1], *grammar_trees))
        accepted = verify(tree, out.logits, sb, [sampling_rule(r, self.sampling) for r in reqs])
        path_tokens = tree.tokens.gather(1, accepted.index)
        width = accepted.index.shape[1]
        rows = None
        if self.capture or any(r.return_logprob for r in reqs):
            # Emitted token i of request b: the drafted child on the accepted path, then the bonus; its
            # distribution is that of path node i, the flat logits row starts[b] + index[b, i].
            sizes = to_device(tree.sizes, device)
            rows = (sizes.cumsum(0) - sizes)[:, None] + accepted.index
        logprobs = None
        if any(r.return_logprob for r in reqs):
            emitted = torch.where(torch.arange(width, device=device)[None, :] == accepted.length[:, None] - 1,
                                  accepted.bonus[:, None], torch.cat([path_tokens[:, 1:], path_tokens[:, :1]], 1))
            logprobs = _logprobs(sb, out.logits, reqs, rows, emitted)
        # The step's one host synchronisation: accepted lengths, bonus tokens, accepted paths, and the
        # emitted tokens' logprobs where asked.
        host, floats = _to_host(torch.cat([accepted.length[:, None], accepted.bonus[:, None], accepted.index,
                                           path_tokens], 1), logprobs)
        lengths = [h[0] for h in host]
        paths = [h[2:2 + n] for h, n in zip(host, lengths)]
        tokens = [h[3 + width:2 + width + n] + [h[1]] for h, n in zip(host, lengths)]
        kept = torch.zeros(step.slots.shape, dtype=torch.bool)      # on the host, where the scheduler reads it
        kept[[b for b, path in enumerate(paths) for _ in path], [i for path in paths for i in path]] = True
        if self.drafter:
            start = time.perf_counter()
            self.drafter.after_verify(step, out, tree.sizes, paths, tokens)
            drafting += time.perf_counter() - start
        captured = None
        if self.capture:
            on_path = torch.arange(width, device=device)[None, :] < accepted.length[:, None]
            picked = cpu_argmax.argmax(out.logits[rows[on_path]])
            captured = self._captured(out, rows[on_path], lengths, reqs, picked)
        predicted = [sum(i >= n for i in path) for path, n in zip(paths, own)] if step.chain_slots else None
        return StepResult(tokens, lengths, kept=kept, drafts=[n - 1 for n in lengths] if self.drafter else None,
                          captured=captured, logprobs=None if floats is None else _unpack(reqs, floats, lengths, width),
                          predicted=predicted, rows=sum(tree.sizes),
                          proposed=[n - 1 for n in own] if self.drafter else None,
                          draft_seconds=drafting)

    def _drafter_view(self, step: DecodeStep) -> DecodeStep:
        """The step as the drafter sees it: its tree's slot columns, then its scratch, without the
        columns given to prediction chains."""
        if not step.chain_slots:
            return step
        n = self.num_draft_tokens
        return DecodeStep(step.reqs, torch.cat([step.slots[:, :n], step.slots[:, n + step.chain_slots:]], 1),
                          drafts=step.drafts)

    def _nodes_as_decode_rows(self, reqs, tree: TreeBatch, slots: torch.Tensor):
        """The tree verified as decode rows, SGLang's "decode" attention mode: node i of request b is a
        row of one token after the request's cached prefix, its drafted ancestors' slots as extra keys.
        One host read of the depths: the rows' extra key counts."""
        valid, depth = tree.valid, tree.depth
        B, N = tree.tokens.shape
        strict = tree.ancestors & ~torch.eye(N, dtype=torch.bool, device=slots.device)
        extra = slots[:, None, :N].expand(B, N, N)[strict & valid[:, :, None]]
        node_req = torch.arange(B).repeat_interleave(torch.tensor(tree.sizes)).tolist()
        return make_batch(self.table, [reqs[b].row for b in node_req], [reqs[b].kv_len for b in node_req],
                          tree.tokens[valid], slots[:, :N][valid], [1] * len(node_req),
                          positions=(to_device([r.kv_len for r in reqs], slots.device)[:, None] + depth)[valid],
                          extra_slots=extra, extra_lens=depth[valid].tolist(), capture_hidden=self.capture_hidden)

    def _captured(self, out: ForwardOutput, rows: torch.Tensor, lens: Sequence[int], reqs, argmax: torch.Tensor) -> list:
        """Per request, the committed positions' states: (first position, captured states [n, sum of
        widths] in `capture` order, final hidden [n, H], argmax [n], -1 where no logits were computed).
        `rows` [sum(lens)]: their rows in the forward, request after request. Copies, not views."""
        aux = torch.cat([out.captured[i].index_select(0, rows) for i in self.capture], dim=-1)
        final = out.hidden.index_select(0, rows)
        return [(r.kv_len, a, f, m) for r, a, f, m in zip(reqs, aux.split(list(lens)), final.split(list(lens)),
                                                          argmax.split(list(lens)))]


def _logprobs(sb: SamplingBatch, logits: torch.Tensor, reqs, rows: torch.Tensor, tokens: torch.Tensor):
    """Packed logprobs (SamplingBatch.logprobs) of tokens [B, K] at logits rows [B, K], [B, K * width];
    None when no request asked. Computed for every row of the batch: one batched op, on K rows each."""
    asking = [r for r in reqs if r.return_logprob]
    if not asking:
        return None
    packed = sb.logprobs(logits, rows.flatten(), tokens.flatten(), max(r.top_logprobs_num for r in asking))
    return packed.view(rows.shape[0], -1)


def _to_host(ints: torch.Tensor, floats: Optional[torch.Tensor]):
    """One device-to-host copy of a step's integers [B, K] and, when logprobs were asked, floats [B, F]:
    (int rows, float rows or None)."""
    if floats is None:
        return ints.tolist(), None
    k = ints.shape[1]
    rows = torch.cat([ints.double(), floats], 1).tolist()
    return [[int(x) for x in r[:k]] for r in rows], [r[k:] for r in rows]


def _unpack(reqs, floats: list[list[float]], counts: Sequence[int], positions: int) -> list:
    """Per request: None, or the logprobs of its first counts[b] emitted tokens (of `positions` packed)."""
    out = []
    for req, row, n in zip(reqs, floats, counts):
        width = len(row) // positions
        out.append([unpack_logprobs(row[i * width:(i + 1) * width], req.top_logprobs_num) for i in range(n)]
                   if req.return_logprob else None)
    return out
