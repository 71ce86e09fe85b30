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

from typing import Optional, Sequence

import torch

from engine.forward_batch import make_batch
from engine.model_runner import ForwardOutput, ModelRunner
from engine.sampling import PathTokens, SamplingBatch
from engine.speculative.drafter import Drafter
from engine.speculative.tree import TreeBatch
from engine.speculative.verify import verify
from engine.step import DecodeStep, PrefillStep, StepResult


class Worker:
    def __init__(self, target: ModelRunner, table: torch.Tensor, eos_ids: Sequence[int],
                 drafter: Optional[Drafter] = None, num_draft_tokens: int = 1, rejection: bool = False,
                 tree_as_decode: bool = False):
        self.target, self.table, self.eos_ids = target, table, list(eos_ids)
        self.drafter, self.num_draft_tokens, self.rejection = drafter, num_draft_tokens, rejection
        # --speculative-attention-mode decode: every tree node is a decode row of its own.
        self.tree_as_decode = tree_as_decode
        self.capture: tuple[int, ...] = ()          # hidden states to return per request (Request.captured)

    @property
    def slots_per_request(self) -> int:
        """KV slots one request may use in a decode step: a tree's, plus the drafter's scratch."""
        return self.num_draft_tokens + (self.drafter.scratch_slots if self.drafter else 0)

    @property
    def _capture_hidden(self) -> tuple[int, ...]:
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
                           lens, capture_hidden=self._capture_hidden)
        done = [i for i in range(len(reqs)) if step.completes(i)]
        ends = torch.tensor(lens).cumsum(0) - 1
        out = self.target.forward(batch, ends[done].to(self.table.device))
        first: list[int] = []
        if done:
            first = SamplingBatch([reqs[i] for i in done], self.eos_ids, self.table.device).sample(out.logits).tolist()
        sampled = dict(zip(done, first))
        next_tokens = [sampled[i] if i in sampled else r.token_ids[r.kv_len + n] for i, (r, n) in enumerate(zip(reqs, lens))]
        if self.drafter:
            self.drafter.after_prefill(step, out, next_tokens)
        captured = None
        if self.capture:
            argmax = torch.full((int(ends[-1]) + 1,), -1, dtype=torch.long, device=out.hidden.device)
            if done:
                argmax[ends[done].to(argmax.device)] = out.logits.argmax(-1)
            captured = self._captured(out, torch.arange(len(argmax), device=argmax.device), lens, reqs, argmax)
        return StepResult([[sampled[i]] if i in sampled else [] for i in range(len(reqs))], list(lens), captured=captured)

    # ------------------------------------------------------------------ decode
    def _decode(self, step: DecodeStep) -> StepResult:
        reqs, device = step.reqs, self.table.device
        tree = (self.drafter.draft(step) if self.drafter else
                TreeBatch.roots(torch.tensor([r.token_ids[-1] for r in reqs], device=device)))
        full = all(n == tree.width for n in tree.sizes)

        def flat(x: torch.Tensor) -> torch.Tensor:
            return x.flatten(0, 1) if full else x[tree.valid]

        depth = tree.depth
        kv = torch.tensor([r.kv_len for r in reqs], device=device)
        slots = step.slots.to(device)
        if self.tree_as_decode and tree.width > 1:
            batch = self._nodes_as_decode_rows(reqs, tree, slots)
        else:
            batch = make_batch(self.table, [r.row for r in reqs], [r.kv_len for r in reqs],
                               flat(tree.tokens), flat(slots[:, :tree.width]), tree.sizes,
                               positions=flat(kv[:, None] + depth), masks=None if tree.is_chain else tree.ancestors,
                               capture_hidden=self._capture_hidden)
        out = self.target.forward(batch, all_logits=True, decode=True)
        sb = SamplingBatch(reqs, self.eos_ids, device, rows_per_req=tree.sizes, depth=flat(depth),
                           paths=PathTokens(tree.ancestors, tree.tokens) if tree.width > 1 else None)
        rejection = [self.rejection and tree.draft_probs is not None and not r.params.greedy for r in reqs]
        accepted = verify(tree, out.logits, sb, rejection)
        # The step's one host synchronisation: accepted lengths, bonus tokens and accepted paths.
        path_tokens = tree.tokens.gather(1, accepted.index)
        width = accepted.index.shape[1]
        host = torch.cat([accepted.length[:, None], accepted.bonus[:, None], accepted.index, path_tokens], 1).tolist()
        lengths = [h[0] for h in host]
        paths = [h[2:2 + n] for h, n in zip(host, lengths)]
        tokens = [h[3 + width:2 + width + n] + [h[1]] for h, n in zip(host, lengths)]
        on_path = torch.arange(width, device=device)[None, :] < accepted.length[:, None]
        kept = torch.zeros(slots.shape, dtype=torch.bool, device=device)
        kept.scatter_(1, accepted.index, on_path)
        kept[:, 0] = True                   # the root: padding indices point at it too, never unset it
        if self.drafter:
            self.drafter.after_verify(step, out, tree.sizes, paths, tokens)
        captured = None
        if self.capture:
            sizes = torch.tensor(tree.sizes, device=device)
            rows = ((sizes.cumsum(0) - sizes)[:, None] + accepted.index)[on_path]
            captured = self._captured(out, rows, lengths, reqs, out.logits[rows].argmax(-1))
        return StepResult(tokens, lengths, kept=kept, drafts=[n - 1 for n in lengths] if self.drafter else None,
                          captured=captured)

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
                          positions=(torch.tensor([r.kv_len for r in reqs], device=slots.device)[:, None] + depth)[valid],
                          extra_slots=extra, extra_lens=depth[valid].tolist(), capture_hidden=self._capture_hidden)

    def _captured(self, out: ForwardOutput, rows: torch.Tensor, lens: Sequence[int], reqs, argmax: torch.Tensor) -> list:
        """Per request, the committed positions' states: (first position, captured states [n, sum of
        widths] in `capture` order, final hidden [n, H], argmax [n], -1 where no logits were computed).
        `rows` [sum(lens)]: their rows in the forward, request after request. Copies, not views."""
        aux = torch.cat([out.captured[i].index_select(0, rows) for i in self.capture], dim=-1)
        final = out.hidden.index_select(0, rows)
        return [(r.kv_len, a, f, m) for r, a, f, m in zip(reqs, aux.split(list(lens)), final.split(list(lens)),
                                                          argmax.split(list(lens)))]
