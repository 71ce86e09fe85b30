"""Logit processing and sampling for a whole batch at once, on the logits' device.

A row is one position to sample from. Rows come in runs, one run per request (one row in plain decoding,
one per tree node in verification): `SamplingBatch` holds the requests' settings as tensors expanded to
rows, with each row's depth below the request's newest token (a tree node's path of draft tokens counts
towards penalties and min_new_tokens). `probs` gives the exact distribution a row samples from;
`sample` draws from it by Gumbel-max with noise keyed by (seed, output position)
(kernels/cpu_keyed_sample.c): the token is a function of the row's distribution, the seed and the
position alone, never of batching, preemption or speculation, so verification reproduces plain
decoding's draws node by node (speculative/verify.py, the coupled rule), and a draft sampled from its
own distribution with the same key agrees with the target's draw when the two are close.
`sample_from_probs` draws by inverse CDF with a uniform of (seed, position, stream), for the rules
whose draws depend on the drafts (tree and rejection sampling).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

from engine.core.sampling_params import SamplingParams
from engine.core.to_device import to_device
from spec_kernels.cpu_argmax import argmax
from spec_kernels.cpu_keyed_sample import GOLDEN, keyed_sample, mix, shr


class Sampled(Protocol):
    """What sampling reads of a request (engine.core.request.Request has it)."""
    params: SamplingParams
    token_ids: list[int]
    prompt_len: int
    seed: int


@dataclass
class PathTokens:
    """Draft tokens on each tree node's path, for penalties: node i of request b has drafted
    tokens[b, j] for every j > 0 with ancestors[b, i, j] (the root is the request's newest token)."""
    ancestors: torch.Tensor      # [B, N, N] bool
    tokens: torch.Tensor         # [B, N]


class SamplingBatch:
    def __init__(self, reqs: Sequence[Sampled], eos_ids: Sequence[int], device, *,
                 rows_per_req: Optional[Sequence[int]] = None, depth: Optional[torch.Tensor] = None,
                 paths: Optional[PathTokens] = None, bitmask: Optional[tuple[torch.Tensor, list[int]]] = None):
        """bitmask: grammar masks (engine/core/grammar.py row_bitmask): [R, words] on the host, and the rows
        they constrain."""
        self.reqs, self.eos_ids, self.device = list(reqs), list(eos_ids), device
        self.rows_per_req = list(rows_per_req) if rows_per_req is not None else [1] * len(reqs)
        self.paths, self.bitmask = paths, bitmask
        counts = to_device(self.rows_per_req, device)
        self.req_of = torch.repeat_interleave(torch.arange(len(reqs), device=device), counts,
                                              output_size=sum(self.rows_per_req))
        self.depth = depth if depth is not None else torch.zeros_like(self.req_of)
        params = [r.params for r in reqs]
        self.all_greedy = all(p.greedy for p in params)
        self.needs_adjust = bitmask is not None or any(p.has_penalties or p.min_new_tokens or p.logit_bias
                                                       for p in params)
        self._per_req: dict[str, torch.Tensor] = {}
        self._adjusted: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    # ------------------------------------------------------------------ per-row settings
    def _row(self, name: str, values, dtype) -> torch.Tensor:
        if name not in self._per_req:
            self._per_req[name] = to_device(values, self.device, dtype)
        return self._per_req[name][self.req_of]

    @property
    def greedy(self) -> torch.Tensor:
        return self._row("greedy", [r.params.greedy for r in self.reqs], torch.bool)

    @property
    def temperatures(self) -> torch.Tensor:
        """Per row: the request's temperature, 1 for greedy rows."""
        return self._row("temp", [r.params.temperature if not r.params.greedy else 1.0 for r in self.reqs],
                         torch.float32)

    @property
    def positions(self) -> torch.Tensor:
        """Output position each row samples: the request's generated count plus the row's depth."""
        return self._row("out", [len(r.token_ids) - r.prompt_len for r in self.reqs], torch.int64) + self.depth

    def keys(self) -> torch.Tensor:
        """One sampling key per row, at the row's output position (stream 0: the target's draws)."""
        return keys(self._row("seed", [r.seed for r in self.reqs], torch.int64), self.positions, 0)

    def request_keys(self, depth: torch.Tensor, stream) -> torch.Tensor:
        """Keys per request at `depth` [B] or [B, K] tokens past its newest."""
        self._row("seed", [r.seed for r in self.reqs], torch.int64)
        self._row("out", [len(r.token_ids) - r.prompt_len for r in self.reqs], torch.int64)
        shape = (-1,) + (1,) * (depth.dim() - 1)
        seeds, out = self._per_req["seed"].view(shape), self._per_req["out"].view(shape)
        return keys(seeds.expand_as(depth), out + depth, stream)

    def request_uniforms(self, depth: torch.Tensor, stream) -> torch.Tensor:
        """Uniforms per request at `depth` [B] or [B, K] tokens past its newest."""
        return uniform(self.request_keys(depth, stream))

    # ------------------------------------------------------------------ logits to distributions
    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalties, min_new_tokens, logit_bias and grammar masks on fp32 logits [R, V] (a new tensor
        when anything changes; computed once per logits tensor, as sampling, verification and logprobs
        all read it). Python loops over the requests that use them only: they are rare, and per
        request anyway."""
        if self._adjusted is not None and self._adjusted[0] is logits:
            return self._adjusted[1]
        out = self._adjust(logits)
        self._adjusted = (logits, out)
        return out

    def _adjust(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if not self.needs_adjust:
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        start = 0
        for b, (req, n) in enumerate(zip(self.reqs, self.rows_per_req)):
            rows, start = slice(start, start + n), start + n
            p = req.params
            if p.has_penalties:
                self._penalize(logits, rows, b, req, n, vocab)
            if p.min_new_tokens and not p.ignore_eos:
                blocked = self.positions[rows] < p.min_new_tokens
                ids = [t for t in self.eos_ids + list(p.stop_token_ids) if t < vocab]
                if ids:
                    sub = logits[rows]                                  # a view: written in place
                    sub[:, ids] = torch.where(blocked[:, None], float("-inf"), sub[:, ids])
            if p.logit_bias:
                ids = to_device([int(t) for t in p.logit_bias], logits.device)
                sub = logits[rows]
                sub[:, ids] += to_device(list(p.logit_bias.values()), logits.device)
        if self.bitmask is not None:
            from engine.core.grammar import apply_bitmask

            apply_bitmask(logits, *self.bitmask)
        return logits

    def _penalize(self, logits: torch.Tensor, rows: slice, b: int, req: Sampled, n: int, vocab: int) -> None:
        seen, drafted = self._history(b, req, n, vocab)     # [n, V] counts over prompt+output, output
        p = req.params
        if p.repetition_penalty != 1.0:
            # transformers' rule over prompt and output: shrink positive logits, grow negative ones.
            vals = logits[rows]
            hit = seen > 0
            logits[rows] = torch.where(hit, torch.where(vals > 0, vals / p.repetition_penalty,
                                                        vals * p.repetition_penalty), vals)
        if p.frequency_penalty or p.presence_penalty:
            # OpenAI's rule, over generated tokens only.
            logits[rows] -= p.frequency_penalty * drafted + p.presence_penalty * (drafted > 0)

    def _history(self, b: int, req: Sampled, n: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token counts per row [n, V]: over prompt + output + path, and over output + path."""
        ids = to_device(req.token_ids, self.device, torch.long)
        ids = ids[ids < vocab]
        output = to_device(req.token_ids[req.prompt_len:], self.device, torch.long)
        output = output[output < vocab]
        out_counts = torch.bincount(output, minlength=vocab)[:vocab].float().expand(n, vocab).clone()
        if self.paths is not None and n > 1:
            anc = self.paths.ancestors[b, :n, 1:n]                      # drafted ancestors, root excluded
            node, j = anc.nonzero(as_tuple=True)
            out_counts.index_put_((node, self.paths.tokens[b, 1:n][j]), torch.ones_like(node, dtype=torch.float),
                                  accumulate=True)
        seen = out_counts.clone()
        seen[:, ids.unique()] += 1          # presence in prompt + output (repetition penalty only tests > 0)
        return seen, out_counts

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution each row samples from [R, V]: greedy rows one-hot at the argmax; others
        temperature, then top-k, top-p and min-p (SGLang's order), renormalised."""
        logits = self.adjust(logits)
        if self.all_greedy:
            return _one_hot(argmax(logits), logits.shape[-1])
        vocab = logits.shape[-1]
        temps = self.temperatures
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        params = [r.params for r in self.reqs]
        if any(0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0 for p in params if not p.greedy):
            probs = self._truncate(probs, vocab)
        greedy = self.greedy
        return torch.where(greedy[:, None], _one_hot(argmax(logits), vocab), probs)

    def _truncate(self, probs: torch.Tensor, vocab: int) -> torch.Tensor:
        top_k = self._row("top_k", [min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in self.reqs],
                          torch.int64)
        top_p = self._row("top_p", [r.params.top_p for r in self.reqs], torch.float32)
        min_p = self._row("min_p", [r.params.min_p for r in self.reqs], torch.float32)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=probs.device)[None, :]
        keep = ranks < top_k[:, None]
        sorted_probs = sorted_probs * keep
        # top-p over the top-k distribution: a token goes once the mass ranked above it exceeds p.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        keep &= mass_before <= top_p[:, None]
        keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
        keep[:, 0] = True
        out = torch.zeros_like(probs).scatter_(-1, order, sorted_probs * keep)
        return out / out.sum(-1, keepdim=True)

    def logprobs(self, logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, top_n: int) -> torch.Tensor:
        """Log-probabilities of tokens[k] at logits row rows[k], and the top_n best there, packed per
        row as [logprob, top_n values, top_n ids] in float64 (ids are exact below 2**53), ready for the
        step's host transfer. The distribution is the one sampling starts from: after penalties,
        logit_bias, grammar and temperature (greedy rows: 1), before top-k/top-p/min-p truncation,
        which would leave every alternative at -inf (SGLang's definition)."""
        lp = torch.log_softmax(self.adjust(logits)[rows] / self.temperatures[rows, None], dim=-1)
        chosen = lp.gather(1, tokens[:, None]).double()
        if not top_n:
            return chosen
        values, ids = lp.topk(min(top_n, lp.shape[-1]), dim=-1)
        return torch.cat([chosen, values.double(), ids.double()], dim=1)

    def sample(self, logits: torch.Tensor, probs: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Next token per row [R]: the argmax for greedy rows, the keyed draw for the others from
        `probs` (self.probs(logits) when not given)."""
        if self.all_greedy:
            return argmax(self.adjust(logits))
        return keyed_sample(self.probs(logits) if probs is None else probs, self.keys())


def _one_hot(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.zeros((ids.shape[0], vocab), device=ids.device).scatter_(1, ids[:, None], 1.0)


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row with uniforms u [R] in [0, 1). Zero-probability tokens never come out."""
    cdf = probs.double().cumsum(-1)
    target = u.to(cdf.device, torch.float64)[:, None] * cdf[:, -1:]
    ids = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    last_nonzero = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(-1)
    return torch.minimum(ids, last_nonzero)


# ---------------------------------------------------------------------------------------- randomness
def keys(seeds: torch.Tensor, positions: torch.Tensor, stream) -> torch.Tensor:
    """A 64-bit key per row (int64), fixed by (seed, output position, stream): splitmix64 twice."""
    h = mix(seeds.to(torch.int64) * GOLDEN + positions.to(torch.int64))
    return mix(h + (torch.as_tensor(stream, dtype=torch.int64, device=h.device) + 1) * GOLDEN)


def uniform(key: torch.Tensor) -> torch.Tensor:
    """The uniform in [0, 1) (float64) of each key."""
    return shr(key, 11).double() * 2.0 ** -53


def choice_seed(seed: int, choice: int) -> int:
    """The seed choice `choice` of an n-choice request samples with: the request's own for the first, a
    hash of (seed, choice) for the others, so that no two (seed, choice) pairs share a stream."""
    if choice == 0:
        return seed
    return int(keys(torch.tensor([seed]), torch.tensor([choice]), -1))


# Reported instead of -inf (a token the grammar or min_new_tokens rules out): JSON has no infinity.
LOGPROB_FLOOR = -9999.0


def unpack_logprobs(row: list[float], top_n: int) -> tuple[float, list[tuple[int, float]]]:
    """One row of SamplingBatch.logprobs on the host: (logprob, [(token id, logprob)] best first)."""
    k = (len(row) - 1) // 2 if top_n else 0
    return max(row[0], LOGPROB_FLOOR), [(int(t), max(v, LOGPROB_FLOOR))
                                        for v, t in zip(row[1:1 + k], row[1 + k:1 + 2 * k])][:top_n]
