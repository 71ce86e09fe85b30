"""EAGLE (EAGLE-1/2), EAGLE-3 and MTP drafting: a one-layer draft reads the target's features.

At position t the draft takes (token x_{t+1}, feature f_t): f_t is the target's hidden state at t
(EAGLE: the final normed one; EAGLE-3: fc over three captured ones; MTP: the final one) for committed
tokens, and the draft's own output for drafted ones. Its output at t gives the distribution of x_{t+2}.
So its KV at position t depends on the token after t: the radix cache keys pairs of tokens for it.

The draft's cache follows the target's (model_drafter.py): after a prefill piece over positions
[s, s + n) it is fed tokens x_{s+1} .. x_{s+n} (the last one the next prompt token or the sampled
first output) with the target's features of the piece; after a verification, the accepted path's
tokens shifted by one (the bonus last) with the target's features at the path's nodes, at the slots
the path is committed to. The output at the newest position, `last` (kept per table row), gives the
roots' draft distribution at the next step: the root's children are fed at position kv_len.
MTP runs the same way with a multi-token-prediction layer as the draft (engine/models/mtp.py): the
target's own, or a separate nextn checkpoint's given as the draft path; with several MTP layers and
--enable-multi-layer-eagle, MultiLayerMtpDrafter runs layer k for draft step k.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
from torch import nn

from engine.attention import create_backend
from engine.config import ServerArgs
from engine.errors import ConfigError
from engine.core.forward_batch import ForwardBatch, make_batch
from engine.loader import resolve_model_path
from engine.memory.kv_pool import KVPool
from engine.core.model_runner import ForwardOutput, kv_layout
from engine.models.eagle import load_eagle_draft
from engine.models.mtp import load_mtp_draft
from engine.core.request import Request
from engine.speculative.draft_tree_search import search_trees
from engine.speculative.model_drafter import ModelDrafter
from engine.speculative.token_map import load_token_map
from engine.speculative.tree import TreeBatch
from engine.core.step import DecodeStep, PrefillStep
from engine.core.to_device import to_device

log = logging.getLogger(__name__)


def load_draft(args: ServerArgs, target: nn.Module, target_dir, dtype: torch.dtype, device: str,
               max_positions: int) -> nn.Module:
    algorithm = args.speculative_algorithm
    hot = None
    if args.speculative_token_map:
        if algorithm == "EAGLE3":
            log.warning("--speculative-token-map is ignored with EAGLE3: its draft has its own reduced "
                        "vocabulary (d2t).")
        else:
            hot = load_token_map(args.speculative_token_map, target.config.vocab_size)
    kw = dict(max_positions=max_positions, dtype=dtype, device=device, hot_ids=hot)
    # Without a draft path (MTP only: the flags require one for EAGLE/EAGLE3) the draft is the target's
    # own MTP layer.
    own = not args.speculative_draft_model_path
    draft_dir = target_dir if own else resolve_model_path(args.speculative_draft_model_path,
                                                          args.speculative_draft_model_revision)
    if algorithm == "MTP":
        layers = args.speculative_num_steps if args.enable_multi_layer_eagle else 1
        model = load_mtp_draft(draft_dir, target, own=own, num_layers=layers, **kw)
    else:
        model = load_eagle_draft(algorithm, draft_dir, target, **kw)
    kind = _head_quantization(args, target, target_dir, device)
    if kind is not None:
        from engine.models.quant import quantize_loaded

        quantize_loaded(model, kind)
    log.info("%s draft %s: aux hidden states %s", algorithm, draft_dir, model.aux_layers or "none")
    return model


def _head_quantization(args: ServerArgs, target: nn.Module, target_dir, device: str) -> Optional[str]:
    """The head's weight format: the one named, or with auto w4a8 beside a target loaded with w4a8
    layers (its layers then run in the target's kernel: faster EAGLE-3 steps at the same accept length,
    docs/convert.md; drafts never change the output), else
    the checkpoint's own weights."""
    from engine.core.model_runner import resolve_quantization
    from engine.models.quant import W4A8Linear

    name = args.speculative_draft_model_quantization
    if name == "auto":
        # Exactly W4A8Linear: its subclass Int8GroupLinear also serves int4 targets' wider layers.
        return "w4a8" if any(type(m) is W4A8Linear for m in target.modules()) else None
    return resolve_quantization(name, target_dir, device, args.dtype)


class EagleDrafter(ModelDrafter):
    position_shift = -1

    def __init__(self, model: nn.Module, target: nn.Module, num_slots: int, max_rows: int, table: torch.Tensor,
                 tree: tuple[int, int, int], sampling: str, eos_ids: Sequence[int], backend: str):
        super().__init__(*tree, sampling, eos_ids, table)
        self.model, self.target = model, target
        self.capture_hidden = tuple(model.aux_layers)
        device, dtype = table.device, next(model.parameters()).dtype
        layers, heads, head_dim = kv_layout(model)
        self.kv_pool = KVPool(layers, num_slots, heads, head_dim, dtype, device)
        self.backend = create_backend(backend, str(device), self.kv_pool, draft=True)
        self.last = torch.zeros((max_rows, target.config.hidden_size), dtype=dtype, device=device)

    def _feed(self, batch: ForwardBatch, features: torch.Tensor) -> torch.Tensor:
        self.backend.prepare(batch)
        return self.model(self.target.embed(batch.input_ids), features, batch.positions, batch, self.backend)

    def _scores(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    def root(self, step: DecodeStep, roots: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        state = self.last[to_device([r.row for r in step.reqs], self.last.device)]
        return self.scores(state), state

    def _extend(self, rows: list[int], prefix: list[int], tokens, slots: torch.Tensor, lens: list[int],
                features: torch.Tensor) -> None:
        """Feed committed positions (tokens shifted by one, the target's features) and keep each row's
        output at its newest position."""
        hidden = self.feed(make_batch(self.table, rows, prefix, tokens, slots, lens), features)
        ends = to_device(lens, hidden.device).cumsum(0) - 1
        self.last[to_device(rows, hidden.device)] = hidden[ends].to(self.last.dtype)

    def after_prefill(self, step: PrefillStep, out: ForwardOutput, next_tokens: Sequence[int]) -> None:
        tokens = [t for req, n, nxt in zip(step.reqs, step.lens, next_tokens)
                  for t in req.token_ids[req.kv_len + 1:req.kv_len + n] + [nxt]]
        features = self.model.target_features(out.hidden, out.captured, slice(None))
        self._extend([r.row for r in step.reqs], [r.kv_len for r in step.reqs], tokens, step.slots, step.lens,
                     features)

    def after_verify(self, step: DecodeStep, out: ForwardOutput, sizes: Sequence[int],
                     paths: Sequence[Sequence[int]], tokens: Sequence[Sequence[int]]) -> None:
        # Path node j sits at position kv_len + j; the token after it is the j-th that came out.
        starts = [sum(sizes[:b]) for b in range(len(sizes))]
        rows = to_device([s + i for s, path in zip(starts, paths) for i in path], out.hidden.device)
        slots = torch.cat([step.slots[b, path] for b, path in enumerate(paths)])
        features = self.model.target_features(out.hidden, out.captured, rows)
        self._extend([r.row for r in step.reqs], [r.kv_len for r in step.reqs], [t for ts in tokens for t in ts],
                      slots, [len(p) for p in paths], features)


class MultiLayerMtpDrafter(EagleDrafter):
    """--enable-multi-layer-eagle: draft step k (0-based) runs MTP layer k, as SGLang's multi-layer EAGLE
    worker runs MiMo-V2's layers. Every layer reads the target's feature f_t; layer k at position t reads
    the token k + 1 places on, x_{t+k+1}, and predicts x_{t+k+2} (layer 0 is the EAGLE draft above).

    Layer k's K/V (layer k of the draft's pool, at the target's slots) at position t can be committed once
    x_{t+k+1} is: after each target pass, layer k is fed the same new tokens as layer 0 at positions k
    earlier, with the target's features of those positions (the newest steps - 1 are kept per row in
    `tail`). To draft token k + 1, layer k runs over the newest k positions with the drafted tokens
    1 .. k in scratch slots (its own buffer: every layer reuses the same k slots) and its output at the
    newest position scores the token. Positions before a request's first own prefill (a radix-shared
    prefix) have no kept features: there layer k keeps the K/V another request gave it, which may lower
    acceptance, never the output. Chains only (topk 1), as in SGLang."""

    def __init__(self, model: nn.Module, *args, **kwargs):
        self.layers = model.num_layers
        super().__init__(model, *args, **kwargs)
        self.tail = torch.zeros((self.last.shape[0], self.layers - 1, self.last.shape[1]), dtype=self.last.dtype,
                                device=self.last.device)
        self.kept = [0] * self.last.shape[0]         # valid rows at the end of tail, per table row

    def set_tree(self, tree: tuple[int, int, int], sampling: str) -> None:
        steps, topk, _ = tree
        if topk != 1 or steps > self.layers:
            raise ConfigError(f"Multi-layer MTP drafting loaded {self.layers} MTP layers for chains: it drafts "
                              f"at most {self.layers} steps with topk 1, not {steps} steps with topk {topk}.")
        super().set_tree(tree, sampling)

    def _run(self, k: int, batch: ForwardBatch, features: torch.Tensor) -> torch.Tensor:
        self.backend.prepare(batch)
        return self.model.layers[k](self.target.embed(batch.input_ids), features, batch.positions, batch,
                                    self.backend)

    def _extend(self, rows: list[int], prefix: list[int], tokens, slots: torch.Tensor, lens: list[int],
                features: torch.Tensor) -> None:
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.table.device)
        features = features.to(self.tail.dtype)
        starts = [sum(lens[:b]) for b in range(len(lens))]
        for k in range(self.layers):
            picked = []     # (row, prefix, tokens, slots, features) of layer k's window per row
            for row, s, n, o in zip(rows, prefix, lens, starts):
                # Positions [s - j, s + n - k): j kept ones before the piece, re-read with the new tokens.
                j = min(k, self.kept[row])
                m = n - k + j
                if m > 0:
                    picked.append((row, s - j, tokens[o + n - m:o + n],
                                   torch.cat([self.table[row, s - j:s], slots[o:o + n].to(self.table.device)])[:m],
                                   torch.cat([self.tail[row, self.layers - 1 - j:], features[o:o + n]])[:m]))
            if not picked:
                continue
            r, p, t, sl, f = zip(*picked)
            w = [len(x) for x in t]
            hidden = self._run(k, make_batch(self.table, r, p, torch.cat(t), torch.cat(sl), w), torch.cat(f))
            if k == 0:
                ends = to_device(w, hidden.device).cumsum(0) - 1
                self.last[to_device(r, hidden.device)] = hidden[ends].to(self.last.dtype)
        for row, n, o in zip(rows, lens, starts):
            kept = min(self.layers - 1, self.kept[row] + n)
            newest = torch.cat([self.tail[row], features[o:o + n]])[-kept:]
            self.tail[row, self.layers - 1 - kept:] = newest
            self.kept[row] = kept

    def _search(self, step: DecodeStep, roots: torch.Tensor, budgets: Optional[Sequence[int]]) -> TreeBatch:
        reqs, device = step.reqs, self.table.device
        rows, kv_lens = [r.row for r in reqs], [r.kv_len for r in reqs]
        scratch = step.slots[:, self.num_draft_tokens:].to(device)
        drafted = []

        def expand(depth: int, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
            # Layer `depth` over the newest w positions, reading the drafted tokens depth - w + 1 .. depth.
            drafted.append(tokens[:, 0])
            chain = torch.stack(drafted, 1)
            w = [min(depth, self.kept[row]) for row in rows]
            batch = make_batch(self.table, rows, [n - x for n, x in zip(kv_lens, w)],
                               torch.cat([chain[b, depth - x:] for b, x in enumerate(w)]),
                               torch.cat([scratch[b, :x] for b, x in enumerate(w)]), w)
            features = torch.cat([self.tail[row, self.layers - 1 - x:] for row, x in zip(rows, w)])
            hidden = self._run(depth, batch, features)
            ends = to_device(w, hidden.device).cumsum(0) - 1
            return self.scores(hidden[ends])[:, None]

        root_scores, _ = self.root(step, roots)
        return search_trees(roots, root_scores, expand, self.steps, 1, self.num_draft_tokens, self._draw(reqs),
                            budgets)

    def release(self, req: Request) -> None:
        self.kept[req.row] = 0
