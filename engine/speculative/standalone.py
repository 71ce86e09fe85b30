"""STANDALONE speculative decoding: a smaller LLM with the target's tokenizer drafts the tree.

The draft runs in a second ModelRunner with its own KV pool (as many tokens as the target's) and
req-to-token table. Its cache holds committed tokens only: each request's `kv_len` there counts the
leading tokens of `req.all_ids` it covers. A draft step
1. catches up: feeds the committed tokens the draft has not seen, ending with the root (the newest
   token), as one extend per request (the draft's prefill the first time, the tokens accepted by the
   last verification later); the root's logits give the first draft level;
2. searches a tree (draft_tree_search) level by level, one draft forward per level. A frontier node sees
   the committed prefix plus its own ancestors: each of a request's topk branches has a table row (its
   own, plus topk - 1 scratch rows) holding the prefix's slots followed by the branch's path;
3. frees the scratch KV and rows: rejecting a draft is forgetting it, and accepted tokens are fed again
   by the next catch-up, so the draft never holds a token the target did not commit.
A request the draft pool cannot hold this step (many radix-shared prefixes, which the draft does not
share) drafts nothing and decodes plainly until there is room.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from engine.config import ServerArgs
from engine.errors import ConfigError, ModelLoadError
from engine.loader import load_config, load_tokenizer, resolve_model_path
from engine.model_runner import ForwardItem, ModelRunner
from engine.request import Request
from engine.speculative.base import SpeculativeWorker
from engine.speculative.draft_tree_search import Frontier, chain_samplers, search_trees
from engine.speculative.token_map import HotVocabHead, load_token_map
from engine.speculative.tree import DraftTree

log = logging.getLogger(__name__)

_NO_LOGITS = torch.empty(0, dtype=torch.long)
# Token ids compared when two tokenizers are checked for being the same one.
_TOKENIZER_SAMPLE = 512


@dataclass
class _DraftState:
    row: int          # row of the draft's req-to-token table
    kv_len: int = 0   # leading tokens of req.all_ids whose KV is in the draft cache


class StandaloneWorker(SpeculativeWorker):
    def __init__(self, runner: ModelRunner, eos_ids: Sequence[int], args: ServerArgs):
        super().__init__(runner, eos_ids, args)
        draft_dir = resolve_model_path(args.speculative_draft_model_path, args.speculative_draft_model_revision)
        config = load_config(draft_dir, args.trust_remote_code)
        self.vocab_size = runner.config.vocab_size
        check_same_vocabulary(args, runner.config, runner.model_dir, draft_dir, config)
        hot = (load_token_map(args.speculative_token_map, min(self.vocab_size, config.vocab_size))
               if args.speculative_token_map else None)
        tokens = runner.allocator.size
        draft_args = dataclasses.replace(
            args, model_path=str(draft_dir), revision=args.speculative_draft_model_revision, tokenizer_path=None,
            dtype=str(runner.dtype).removeprefix("torch."), device=runner.device, max_total_tokens=tokens,
            speculative_algorithm=None, speculative_draft_model_path=None, speculative_draft_model_revision=None,
            speculative_num_steps=None, speculative_eagle_topk=None, speculative_num_draft_tokens=None,
            speculative_token_map=None, speculative_draft_model_quantization=None)
        # A row per running request, plus topk - 1 scratch rows for each while it drafts a tree.
        self.draft_runner = ModelRunner(draft_args, draft_dir, config, kv_pool_tokens=tokens,
                                        max_requests=runner.max_requests * self.topk)
        self.head = (HotVocabHead(self.draft_runner.model.lm_head_weight(), hot, self.vocab_size)
                     if hot is not None else None)
        # As the target's prefill was split, so is the draft's first catch-up over a long prompt.
        self.catch_up_budget = args.prefill_chunk(runner.device)
        self.states: dict[Request, _DraftState] = {}

    # ------------------------------------------------------------------ drafting
    def draft(self, reqs: Sequence[Request]) -> list[DraftTree]:
        trees = [DraftTree.chain(r.all_ids[-1], []) for r in reqs]
        ready = self._admit(reqs)
        if not ready:
            return trees
        drafting = [reqs[i] for i in ready]
        root_scores = self._catch_up(drafting)
        rows = self._branch_rows(drafting)
        scratch: list[torch.Tensor] = []

        def expand(frontiers: list[Frontier]) -> torch.Tensor:
            table = self.draft_runner.req_to_token.table
            items = []
            for req, branch_rows, f in zip(drafting, rows, frontiers):
                start, depth = req.seq_len, f.depth
                if depth > 1:
                    # Each node's path: its parent's path, whose last slot the parent's forward wrote.
                    paths = table[torch.tensor([branch_rows[p] for p in f.parents]), start:start + depth - 1]
                    table[torch.tensor(branch_rows), start:start + depth - 1] = paths
                items += [ForwardItem(row, start + depth - 1, [tok]) for row, tok in zip(branch_rows, f.tokens)]
            slots = self.draft_runner.allocator.alloc(len(items))
            scratch.append(slots)
            return self._scores(self.draft_runner.forward(items, slots, _NO_LOGITS).hidden)

        samplers = chain_samplers(drafting, self.eos_ids, self.topk == 1 and self.use_rejection)
        found = search_trees([r.all_ids[-1] for r in drafting], root_scores, expand, self.steps, self.topk,
                             self.num_draft_tokens, samplers)
        for slots in scratch:
            self.draft_runner.allocator.free(slots)
        for branch_rows in rows:
            for row in branch_rows[1:]:
                self.draft_runner.req_to_token.free(row)
        for i, tree in zip(ready, found):
            trees[i] = tree
        return trees

    def _admit(self, reqs: Sequence[Request]) -> list[int]:
        """Indices of the requests whose catch-up and scratch KV fit in the draft pool now."""
        free = self.draft_runner.allocator.available()
        scratch = (self.steps - 1) * self.topk
        ready = []
        for i, req in enumerate(reqs):
            state = self.states.get(req)
            need = req.seq_len - (state.kv_len if state else 0) + scratch
            if need <= free:
                free -= need
                ready.append(i)
        return ready

    def _catch_up(self, reqs: list[Request]) -> torch.Tensor:
        """Feed each request's committed tokens the draft has not seen, root included, in extends of at
        most `catch_up_budget` tokens per forward; return the roots' draft scores [len(reqs), V]."""
        for req in reqs:
            if req not in self.states:
                self.states[req] = _DraftState(self.draft_runner.req_to_token.alloc())
        states = [self.states[r] for r in reqs]
        root_hidden: list[torch.Tensor] = [None] * len(reqs)
        while pending := [i for i, (r, s) in enumerate(zip(reqs, states)) if s.kv_len < r.seq_len]:
            items, fed, budget = [], [], self.catch_up_budget
            for i in pending:
                if budget == 0:
                    break
                req, state = reqs[i], states[i]
                n = min(req.seq_len - state.kv_len, budget)
                items.append(ForwardItem(state.row, state.kv_len, req.all_ids[state.kv_len:state.kv_len + n]))
                fed.append((i, n))
                budget -= n
            slots = self.draft_runner.allocator.alloc(sum(n for _, n in fed))
            out = self.draft_runner.forward(items, slots, _NO_LOGITS)
            offset = 0
            for i, n in fed:
                states[i].kv_len += n
                offset += n
                if states[i].kv_len == reqs[i].seq_len:
                    root_hidden[i] = out.hidden[offset - 1]
        return self._scores(torch.stack(root_hidden))

    def _branch_rows(self, reqs: list[Request]) -> list[list[int]]:
        """Per request, topk table rows that start with its committed prefix: its own and scratch ones."""
        table = self.draft_runner.req_to_token.table
        rows = []
        for req in reqs:
            own = self.states[req].row
            scratch = [self.draft_runner.req_to_token.alloc() for _ in range(self.topk - 1)]
            table[scratch, :req.seq_len] = table[own, :req.seq_len]
            rows.append([own] + scratch)
        return rows

    def _scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary (-inf where the draft cannot propose)."""
        with torch.inference_mode():
            if self.head is not None:
                return self.head(hidden)
            return fit_vocab(self.draft_runner.model.compute_logits(hidden), self.vocab_size)

    def release(self, req: Request) -> None:
        state = self.states.pop(req, None)
        if state is not None:
            pool = self.draft_runner.req_to_token
            self.draft_runner.allocator.free(pool.table[state.row, :state.kv_len].cpu())
            pool.free(state.row)


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
