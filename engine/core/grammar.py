"""Grammar-constrained decoding with xgrammar: compiled grammars, one matcher per request, and the
token bitmasks of a step's sampling rows.

A request with a constraint (SamplingParams.constraint: JSON schema, regex, EBNF or structural tag)
holds a RequestGrammar whose state is that of its committed tokens: the scheduler advances it as it
appends tokens, nothing else changes it. A step reads it: each row the step samples from gets the
bitmask of the tokens the grammar allows there. A draft tree's node gets the bitmask of the state after
its path (`traverse_draft_tree` walks the tree from the committed state and restores it), so verifying
under the masked target distribution accepts a draft token only where the grammar allows it, and the
output is exactly that of constrained plain decoding. A draft token the grammar refuses gets an
all-allowed row: it is never accepted (its parent's mask excludes it), so its row is never read.

With SamplingParams.reasoning_end the grammar starts where that token sequence first appears in the
output (the end of a reasoning model's thinking): the tokens up to it and its own are free, and the
matcher stays at its start until it is committed. A draft path may complete the sequence: the subtree
below that node is walked from the grammar's start.

xgrammar is imported on first use: a server that never sees a constraint never loads it.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import torch

from engine.errors import RequestError
from engine.core.grammar_worker import CompileWorker, compile_constraint

# Limits checked before compiling: compile time grows steeply with nesting (a JSON schema 600 levels
# deep takes tens of seconds, deeper ones minutes), so deeper ones are refused at once. MAX_DEPTH counts
# JSON nesting (a nested object property is two levels: its schema and `properties`) and a regex's
# parentheses.
MAX_BYTES, MAX_DEPTH = 64 * 1024, 64
# Compiled grammars kept, by their text: repeated schemas (and the n choices of one request) compile once.
CACHE_ENTRIES = 64


class GrammarBackend:
    """Compiles constraints for one tokenizer and vocabulary, within the limits above and, for the
    server, in a child process that is cut short at `compile_timeout` seconds or when the client goes
    (engine/core/grammar_worker.py). Thread-safe: the server compiles off the engine thread."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int], *, enabled: bool = True,
                 any_whitespace: bool = True, compile_timeout: float = 10.0):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, list(eos_ids)
        self.enabled, self.any_whitespace, self.compile_timeout = enabled, any_whitespace, compile_timeout
        self._info = self._compiler = None
        self.worker: Optional[CompileWorker] = None             # the server's compiler process, once used
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()

    def _tokenizer_info(self):
        """xgrammar's view of the vocabulary, built on first use (call with the lock held)."""
        if self._info is None:
            import xgrammar as xgr

            # A copy: the server compiles on a worker thread while the engine thread decodes with the
            # original, and tokenizers' Rust objects are best kept to one thread each.
            self._info = xgr.TokenizerInfo.from_huggingface(copy.deepcopy(self.tokenizer), vocab_size=self.vocab_size,
                                                            stop_token_ids=self.eos_ids)
        return self._info

    def _compile_here(self, kind: str, text: str):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                self._compiler = xgr.GrammarCompiler(self._tokenizer_info())
        return compile_constraint(self._compiler, kind, text, self.any_whitespace)

    def _compile_in_worker(self, kind: str, text: str, cancelled: Callable[[], bool]):
        with self._lock:
            if self.worker is None:
                self.worker = CompileWorker(self._tokenizer_info(), self.any_whitespace)
        return self.worker.compile(kind, text, self.compile_timeout, cancelled)

    def compile(self, kind: str, text: str, cancelled: Optional[Callable[[], bool]] = None):
        """The compiled grammar of a constraint (kind: a SamplingParams.CONSTRAINTS name); a
        RequestError naming `kind` when it is past the limits or does not compile. With `cancelled`
        (the server) it compiles in the child process: past the time limit a RequestError, once
        cancelled() is true CompileCancelled; without, here."""
        if not self.enabled:
            raise RequestError(f"{kind}: constrained decoding is off on this server (--grammar-backend none).", kind)
        check_limits(kind, text)
        key = (kind, text)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = (self._compile_here(kind, text) if cancelled is None
                    else self._compile_in_worker(kind, text, cancelled))
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()

    @staticmethod
    def matcher(compiled, after: Sequence[int] = ()) -> "RequestGrammar":
        """A request's grammar state, at its start; `after`: its reasoning_end."""
        import xgrammar as xgr

        return RequestGrammar(xgr.GrammarMatcher(compiled), after)


class RequestGrammar:
    """A request's grammar at its committed tokens: an xgrammar matcher and, with `after` (the
    request's reasoning_end), how much of that sequence ends the output; until the whole sequence has
    been output every token is allowed and the matcher stays at its start."""

    def __init__(self, matcher, after: Sequence[int] = ()):
        self.matcher, self.after = matcher, tuple(after)
        self.matched = 0                        # after's leading tokens that end the output
        self.started = not self.after

    def fork(self) -> "RequestGrammar":
        twin = RequestGrammar(self.matcher.fork(), self.after)
        twin.matched, twin.started = self.matched, self.started
        return twin

    def accept_token(self, token: int) -> bool:
        """Advance by one token; False where the grammar refuses it (always True before its start)."""
        if self.started:
            return self.matcher.accept_token(token)
        self.matched = _advance(self.after, self.matched, token)
        self.started = self.matched == len(self.after)
        return True

    def is_terminated(self) -> bool:
        """Whether the grammar has ended: its stop token accepted."""
        return self.started and self.matcher.is_terminated()

    def fill_row(self, bitmask: torch.Tensor, row: int) -> bool:
        """bitmask[row] (all allowed on entry): what the grammar allows next; False where it allows
        everything (before its start), the row left as it was."""
        if self.started:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        return self.started

    def fill_tree(self, tokens: list[int], parents: list[int], out: torch.Tensor) -> bool:
        """out[i] (all allowed on entry): the bitmask after node i's path (node 0 the committed root);
        False where the grammar allows everything on every path, out left as it was."""
        if self.started:
            _fill_tree(self.matcher, tokens, parents, out)
            return True
        matched: list[Optional[int]] = [self.matched]           # None: past the sequence's end
        starts = []
        for i in range(1, len(tokens)):
            m = matched[parents[i]]
            m = None if m is None else _advance(self.after, m, tokens[i])
            if m == len(self.after):
                starts.append(i)
                m = None
            matched.append(m)
        for start in starts:                    # each completing node roots a subtree under the grammar
            nodes, index = [start], {start: 0}
            for i in range(start + 1, len(tokens)):
                if parents[i] in index:
                    index[i] = len(nodes)
                    nodes.append(i)
            part = out[nodes]
            _fill_tree(self.matcher, [tokens[i] for i in nodes], [-1] + [index[parents[i]] for i in nodes[1:]], part)
            out[nodes] = part
        return bool(starts)


def _advance(seq: tuple[int, ...], matched: int, token: int) -> int:
    """How many of seq's leading tokens end the output once `token` follows an output that ends with
    seq[:matched] (matched < len(seq)): the longest prefix of seq ending seq[:matched] + token."""
    if token not in seq:
        return 0
    tail = seq[:matched] + (token,)
    return next((k for k in range(len(tail), 0, -1) if tail[-k:] == seq[:k]), 0)


def check_limits(kind: str, text: str) -> None:
    """A RequestError naming `kind` when the constraint is past MAX_BYTES or MAX_DEPTH."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_BYTES:
        raise RequestError(f"{kind} is {size} bytes; this server compiles grammars of at most {MAX_BYTES} bytes.", kind)
    depth = (_json_depth(text) if kind in ("json_schema", "structural_tag")
             else _nesting(text, "(", ")") if kind == "regex" else 0)
    if depth > MAX_DEPTH:
        raise RequestError(f"{kind} nests {depth} levels deep; this server compiles at most {MAX_DEPTH} levels "
                           "(deeper ones can take minutes to compile).", kind)


def _json_depth(text: str) -> int:
    """Nesting depth of a JSON text's objects and arrays; where it does not parse (malformed, or nested
    past the parser's recursion), the depth of its brackets."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return _nesting(text, "[{", "]}")
    depth, level = 0, [(value, 1)]
    while level:
        node, d = level.pop()
        if isinstance(node, (dict, list)):
            depth = max(depth, d)
            level += [(child, d + 1) for child in (node.values() if isinstance(node, dict) else node)]
    return depth


def _nesting(text: str, opening: str, closing: str) -> int:
    """How deep the `opening`/`closing` characters nest in text, backslash-escaped ones left out."""
    depth = deepest = 0
    escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch in opening:
            depth += 1
            deepest = max(deepest, depth)
        elif ch in closing:
            depth -= 1
    return deepest


def row_bitmask(reqs: Sequence, rows_per_req: Sequence[int], vocab: int, tokens: Optional[list[list[int]]] = None,
                parents: Optional[list[list[int]]] = None) -> Optional[tuple[torch.Tensor, list[int]]]:
    """The bitmasks of a step's rows on the host, [R, ceil(vocab / 32)] int32, and the rows that have
    one (None when no row is constrained: no request has a grammar, or none reaches its start). Request
    b owns rows_per_req[b] rows in a run: one row (the next token), or one per tree node when
    `tokens`/`parents` give its tree (node 0 the root, already committed)."""
    if not any(r.grammar is not None for r in reqs):
        return None
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(sum(rows_per_req), vocab)      # all allowed
    rows: list[int] = []
    start = 0
    for b, (req, n) in enumerate(zip(reqs, rows_per_req)):
        if req.grammar is not None and (req.grammar.fill_row(bitmask, start) if n == 1 else req.grammar.fill_tree(
                tokens[b][:n], parents[b][:n], bitmask[start:start + n])):
            rows += range(start, start + n)
        start += n
    return (bitmask, rows) if rows else None


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
    grammar is left as it is."""

    def __init__(self, grammar: RequestGrammar):
        self.states = {0: grammar.fork()}
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
