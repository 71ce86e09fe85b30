"""Grammar-constrained decoding with xgrammar: compiled grammars, one matcher per request, and the
token bitmasks of a step's sampling rows.

A request with a constraint (SamplingParams.constraint: JSON schema, regex, EBNF or structural tag)
holds an xgrammar GrammarMatcher whose state is that of its committed tokens: the scheduler advances it
as it appends tokens, nothing else changes it. A step reads it: each row the step samples from gets the
bitmask of the tokens the grammar allows there. A draft tree's node gets the bitmask of the state after
its path (`traverse_draft_tree` walks the tree from the committed state and restores it), so verifying
under the masked target distribution accepts a draft token only where the grammar allows it, and the
output is exactly that of constrained plain decoding. A draft token the grammar refuses gets an
all-allowed row: it is never accepted (its parent's mask excludes it), so its row is never read.

xgrammar is imported on first use: a server that never sees a constraint never loads it.
"""

from __future__ import annotations

import copy
import re
import threading
from typing import Optional, Sequence

import torch

from engine.errors import RequestError

# How much of a compiler error to quote back to the client.
_MAX_ERROR_CHARS = 400
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarBackend:
    """Compiles constraints for one tokenizer and vocabulary. Thread-safe: the server compiles off the
    engine thread, and xgrammar caches compiled grammars (n choices, repeated schemas compile once)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int], *, enabled: bool = True,
                 any_whitespace: bool = True):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, list(eos_ids)
        self.enabled, self.any_whitespace = enabled, any_whitespace
        self._compiler = None
        self._lock = threading.Lock()

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                # A copy: the server compiles on a worker thread while the engine thread decodes with
                # the original, and tokenizers' Rust objects are best kept to one thread each.
                info = xgr.TokenizerInfo.from_huggingface(copy.deepcopy(self.tokenizer), vocab_size=self.vocab_size,
                                                          stop_token_ids=self.eos_ids)
                self._compiler = xgr.GrammarCompiler(info)
            return self._compiler

    def compile(self, kind: str, text: str):
        """The compiled grammar of a constraint (kind: a SamplingParams.CONSTRAINTS name); a
        RequestError naming `kind` when xgrammar cannot compile it."""
        if not self.enabled:
            raise RequestError(f"{kind}: constrained decoding is off on this server (--grammar-backend none).", kind)
        compiler = self._get_compiler()
        try:
            if kind == "json_schema":
                # xgrammar's strict mode (SGLang's default too): no properties or items beyond those the
                # schema lists, which is what OpenAI's strict structured outputs promise.
                return compiler.compile_json_schema(text, any_whitespace=self.any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "ebnf":
                return compiler.compile_grammar(text)
            if kind == "structural_tag":
                return compiler.compile_structural_tag(text)
        except Exception as exc:      # xgrammar raises RuntimeError, ValueError or its own JSON errors
            message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            message = _LOCATION.sub("", message)       # "[12:00:00] /project/cpp/file.cc:123: " says nothing to a client
            raise RequestError(f"{kind} could not be compiled: {message[:_MAX_ERROR_CHARS]}", kind) from None
        raise AssertionError(kind)

    @staticmethod
    def matcher(compiled):
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)


def row_bitmask(reqs: Sequence, rows_per_req: Sequence[int], vocab: int, tokens: Optional[list[list[int]]] = None,
                parents: Optional[list[list[int]]] = None) -> Optional[tuple[torch.Tensor, list[int]]]:
    """The bitmasks of a step's rows on the host, [R, ceil(vocab / 32)] int32, and the rows that have
    one (None when no request has a grammar). Request b owns rows_per_req[b] rows in a run: one row
    (the next token), or one per tree node when `tokens`/`parents` give its tree (node 0 the root,
    already committed)."""
    if not any(r.grammar is not None for r in reqs):
        return None
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(sum(rows_per_req), vocab)      # all allowed
    rows: list[int] = []
    start = 0
    for b, (req, n) in enumerate(zip(reqs, rows_per_req)):
        if req.grammar is not None:
            if n == 1:
                req.grammar.fill_next_token_bitmask(bitmask, start)
            else:
                _fill_tree(req.grammar, tokens[b][:n], parents[b][:n], bitmask[start:start + n])
            rows += range(start, start + n)
        start += n
    return bitmask, rows


def _fill_tree(matcher, tokens: list[int], parents: list[int], out: torch.Tensor) -> None:
    """out[i]: the bitmask after node i's path. xgrammar reads the tree as first-child / next-sibling
    links; nodes it refuses (and their subtrees) are left all-zero, and get all-allowed rows here."""
    n = len(tokens)
    first_child, next_sibling, last_child = [-1] * n, [-1] * n, [-1] * n
    for i in range(1, n):
        p = parents[i]
        if first_child[p] < 0:
            first_child[p] = i
        else:
            next_sibling[last_child[p]] = i
        last_child[p] = i
    out.zero_()
    matcher.traverse_draft_tree(torch.tensor(first_child), torch.tensor(next_sibling), torch.tensor(tokens), out)
    out[(out == 0).all(-1)] = -1


class DraftGrammar:
    """Grammar states along a draft tree as a drafter builds it (node 0: the request's committed
    state), so that it proposes only tokens the grammar allows. Works on forks: the request's own
    matcher is left as it is."""

    def __init__(self, matcher):
        self.states = {0: matcher.fork()}
        self._tried: dict[tuple[int, int], object] = {}

    def allows(self, node: int, token: int) -> bool:
        state = self.states[node].fork()
        if not state.accept_token(token):
            return False
        self._tried[(node, token)] = state
        return True

    def grow(self, node: int, parent: int, token: int) -> None:
        """Node `node` is `token` under `parent` (a pair `allows` accepted)."""
        self.states[node] = self._tried.pop((parent, token))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Disallowed tokens of `rows` to -inf, in place (xgrammar's kernel for the logits' device)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
