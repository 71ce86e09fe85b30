"""STANDALONE speculative decoding: a smaller LLM with the target's tokenizer drafts the tree.

The draft model runs with its own K/V buffers at the target's slots (model_drafter.py): its cache
covers exactly the target's committed positions. After a verification one draft forward feeds the
accepted drafts at the slots the target commits them to and the bonus token after them: its draft
logits are the next step's root scores, and its K/V waits in a parking slot of the request's table row
(beyond the allocator's slots) until that step copies it into the root's own tree slot, which the
verification then commits. One draft forward a step where there were two (the drafts, then the root:
a memory-bound forward costs about the same for 1 token or 4). A root without parked scores (a
request's first drafted step, or its first after steps without drafts) is fed at its tree slot, after
what the draft skipped. Deeper frontiers see the root and their drafted ancestors.

The draft is fed only for requests it drafts for. A prompt is not fed at its prefill, and a request left
without drafts for a step (--speculative-adaptive, under load) costs the draft nothing: the draft falls
behind the target. The step a request drafts (again) feeds every token the draft skipped, in pieces of
at most CATCH_UP_CHUNK tokens, the last one in the same forward as the root; a request that never
drafts (a batch too large for drafting to pay) never costs a draft forward. Which slots hold the draft's
K/V of their committed token is kept per slot (`fed`), so a prefix that a request fed for left in the
radix cache is not fed again by the request that reuses it, and one it skipped is.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
from torch import nn

from engine.attention import create_backend
from engine.config import ServerArgs
from engine.errors import ConfigError, ModelLoadError
from engine.core.forward_batch import ForwardBatch, make_batch
from engine.loader import load_config, load_tokenizer, resolve_model_path
from engine.memory.kv_pool import KVPool
from engine.core.model_runner import ForwardOutput, ModelRunner, kv_layout, load_model
from engine.speculative.model_drafter import ModelDrafter
from engine.speculative.token_map import HotVocabHead, load_token_map
from engine.core.step import DecodeStep, PrefillStep
from engine.core.to_device import to_device

log = logging.getLogger(__name__)

# Token ids compared when two tokenizers are checked for being the same one.
_TOKENIZER_SAMPLE = 512
# The most skipped tokens fed in one draft forward (a long prompt is caught up in pieces, as prefilled).
CATCH_UP_CHUNK = 512


def load_draft(args: ServerArgs, target: nn.Module, target_dir, dtype: torch.dtype, device: str,
               max_positions: int) -> nn.Module:
    draft_dir = resolve_model_path(args.speculative_draft_model_path, args.speculative_draft_model_revision)
    config = load_config(draft_dir, args.trust_remote_code)
    check_same_vocabulary(args, target.config, target_dir, draft_dir, config)
    from engine.core.model_runner import resolve_quantization
    from engine.models.quant import quantize_draft_head

    quantization = resolve_quantization(args.speculative_draft_model_quantization, draft_dir, device, args.dtype,
                                        config)
    model = load_model(draft_dir, config, dtype, device, max_positions, quantization=quantization, draft=True)
    vocab = target.config.vocab_size
    if not args.speculative_token_map:
        model.draft_head = lambda hidden: fit_vocab(model.compute_logits(hidden), vocab)
        return model
    hot = load_token_map(args.speculative_token_map, min(vocab, config.vocab_size))
    model.draft_head = HotVocabHead(model.lm_head_weight(), hot, vocab, dtype)
    quantize_draft_head(model.draft_head, quantization)     # else a w4a8 draft's map would read bf16 rows
    return model


class StandaloneDrafter(ModelDrafter):
    root_in_kv = True
    catches_up = True

    def __init__(self, model: nn.Module, num_slots: int, table: torch.Tensor, tree: tuple[int, int, int],
                 sampling: str, eos_ids: Sequence[int], backend: str):
        super().__init__(*tree, sampling, eos_ids, table)
        device, dtype = table.device, next(model.parameters()).dtype
        layers, heads, head_dim = kv_layout(model)
        # Slots 1..num_slots are the allocator's, num_slots + 1 pads graph batches; then a parking slot per
        # table row (the module docstring).
        self.kv_pool = KVPool(layers, num_slots + 1 + table.shape[0], heads, head_dim, dtype, device)
        self.parking = num_slots + 2
        self.model = model
        self.runner = ModelRunner(model, self.kv_pool, create_backend(backend, str(device), self.kv_pool, draft=True))
        # Table row -> (root token, its position, the draft's hidden state there), from after_verify.
        self.parked: dict[int, tuple[int, int, torch.Tensor]] = {}
        # Table row -> the first position the draft was not fed, for requests it fell behind on.
        self.behind: dict[int, int] = {}
        # Per slot: the draft's K/V of the token committed there is written (fed with all before it).
        self.fed = torch.zeros(self.kv_pool.size + 2, dtype=torch.bool)

    def _feed(self, batch: ForwardBatch, parent_states: Optional[torch.Tensor]) -> torch.Tensor:
        return self.runner.forward(batch).hidden

    def _scores(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.draft_head(hidden)

    def root(self, step: DecodeStep, roots: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        reqs, device = step.reqs, self.table.device
        parked = [self.parked.pop(r.row, None) for r in reqs]
        starts = [self.behind.pop(r.row, r.kv_len) for r in reqs]
        ready = [b for b, (r, p) in enumerate(zip(reqs, parked))
                 if p is not None and p[:2] == (r.token_ids[-1], r.kv_len) and starts[b] == r.kv_len]
        hidden = [None] * len(reqs)
        if ready:
            rows = to_device([reqs[b].row for b in ready], device)
            self.kv_pool.copy(rows + self.parking, step.slots[ready, 0].to(device))
            for b in ready:
                hidden[b] = parked[b][2]
        if missing := [b for b in range(len(reqs)) if hidden[b] is None]:
            # The root, after whatever the draft fell behind on (positions starts[b] .. kv_len - 1).
            fed = [reqs[b] for b in missing]
            starts = self._catch_up(fed, [starts[b] for b in missing])
            lens = [r.kv_len - s + 1 for r, s in zip(fed, starts)]
            slots = torch.cat([torch.cat([self.table[r.row, s:r.kv_len].cpu(), step.slots[b, :1]])
                               for b, r, s in zip(missing, fed, starts)])
            batch = make_batch(self.table, [r.row for r in fed], starts,
                               [t for r, s in zip(fed, starts) for t in r.token_ids[s:r.kv_len + 1]], slots, lens)
            out = self.feed(batch, None)
            self.fed[slots] = True
            for b, h in zip(missing, out[to_device(lens, out.device).cumsum(0) - 1]):
                hidden[b] = h
        self.fed[step.slots[ready, 0]] = True
        return self.scores(torch.stack(hidden)), None

    def _catch_up(self, reqs, starts: list[int]) -> list[int]:
        """Feed what the draft skipped of each request, in pieces, until at most CATCH_UP_CHUNK tokens
        are left before its newest; returns where each request now stands."""
        starts = list(starts)
        while far := [b for b, (r, s) in enumerate(zip(reqs, starts)) if r.kv_len - s > CATCH_UP_CHUNK]:
            slots = torch.cat([self.table[reqs[b].row, starts[b]:starts[b] + CATCH_UP_CHUNK].cpu() for b in far])
            tokens = [t for b in far for t in reqs[b].token_ids[starts[b]:starts[b] + CATCH_UP_CHUNK]]
            self.feed(make_batch(self.table, [reqs[b].row for b in far], [starts[b] for b in far], tokens, slots,
                                 [CATCH_UP_CHUNK] * len(far)), None)
            self.fed[slots] = True
            for b in far:
                starts[b] += CATCH_UP_CHUNK
        return starts

    def lag(self, req) -> int:
        return req.kv_len - self.behind.get(req.row, req.kv_len)

    def after_prefill(self, step: PrefillStep, out: ForwardOutput, next_tokens: Sequence[int]) -> None:
        # Nothing is fed (the module docstring). The draft stands at the first position it has not seen:
        # a prefix from the radix cache may hold slots it was fed.
        for r in step.reqs:
            if r.row not in self.behind:
                self.behind[r.row] = self._first_unfed(r)
        self.fed[step.slots] = False

    def _first_unfed(self, req) -> int:
        unfed = (~self.fed[self.table[req.row, :req.kv_len].cpu()]).nonzero()
        return int(unfed[0]) if len(unfed) else req.kv_len

    def after_verify(self, step: DecodeStep, out: ForwardOutput, sizes: Sequence[int],
                     paths: Sequence[Sequence[int]], tokens: Sequence[Sequence[int]]) -> None:
        reqs = step.reqs
        drafted = [b for b, k in enumerate(self.budgets(step)) if k > 0]
        for b in sorted(set(range(len(reqs))) - set(drafted)):
            # Committed without the draft: it falls behind from here.
            self.behind.setdefault(reqs[b].row, reqs[b].kv_len)
            self.fed[step.slots[b, paths[b]]] = False
        if not drafted:
            return
        # The root is in the draft cache already; feed the accepted drafts after it, and the bonus, parked.
        reqs, paths, tokens = [reqs[b] for b in drafted], [paths[b] for b in drafted], [tokens[b] for b in drafted]
        slots = torch.cat([torch.cat([step.slots[b, path[1:]], torch.tensor([self.parking + r.row])])
                           for b, r, path in zip(drafted, reqs, paths)])
        lens = [len(path) for path in paths]
        hidden = self.feed(make_batch(
            self.table, [r.row for r in reqs], [r.kv_len for r in reqs], [t for ts in tokens for t in ts], slots,
            lens, extra_slots=step.slots[drafted, 0], extra_lens=[1] * len(reqs)), None)
        self.fed[slots] = True
        last = to_device(lens, hidden.device).cumsum(0) - 1
        for b, (r, h) in enumerate(zip(reqs, hidden[last])):
            self.parked[r.row] = (tokens[b][-1], r.kv_len + lens[b], h)

    def release(self, req) -> None:
        self.parked.pop(req.row, None)
        self.behind.pop(req.row, None)


def fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over a padded vocabulary cut, or extended with -inf, to `vocab_size` columns."""
    extra = vocab_size - logits.shape[-1]
    if extra <= 0:
        return logits[:, :vocab_size]
    return torch.cat([logits, logits.new_full((logits.shape[0], extra), float("-inf"))], dim=-1)


def check_same_vocabulary(args: ServerArgs, target_config, target_dir, draft_dir, draft_config) -> None:
    """A STANDALONE draft must share the target's tokenizer. Vocabulary sizes may differ by padding only:
    both must hold every token of tokenizers that agree."""
    target_size, draft_size = target_config.vocab_size, draft_config.vocab_size
    if target_size == draft_size:
        return
    mismatch = (f"The draft model's vocabulary ({draft_size} tokens) differs from the target's ({target_size} "
                "tokens)")
    target_tok = load_tokenizer(args.tokenizer_path or target_dir, args.trust_remote_code)
    try:
        draft_tok = load_tokenizer(draft_dir, args.trust_remote_code)
    except ModelLoadError:
        draft_tok = None
    real = len(target_tok)
    if draft_tok is None or len(draft_tok) != real or min(target_size, draft_size) < real:
        raise ConfigError(f"{mismatch} by more than padding ({real} real tokens in the target's tokenizer). "
                          "STANDALONE needs a draft with the target's tokenizer; pass such a "
                          "--speculative-draft-model-path, or use EAGLE or NGRAM.")
    sample = torch.linspace(0, real - 1, min(real, _TOKENIZER_SAMPLE)).long().tolist()
    if target_tok.convert_ids_to_tokens(sample) != draft_tok.convert_ids_to_tokens(sample):
        raise ConfigError(f"{mismatch} and its tokenizer maps ids to other tokens. STANDALONE needs a draft "
                          "with the target's tokenizer; pass such a --speculative-draft-model-path.")
    log.info("draft vocabulary %d vs target %d: same tokenizer, padding differs", draft_size, target_size)
