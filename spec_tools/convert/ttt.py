"""EAGLE-3's training-time test: the draft trained on its own unrolled predictions.

Serving, the draft (engine/speculative/eagle.py) caches one entry per committed position t, fed the
next token x_{t+1} and the target's feature f_t (fc over the three auxiliary hidden states); its output
there gives the distribution of x_{t+2}. Drafting further, a node at depth d (position t + d) is fed the
drafted token and its parent's output, and attends to the cached entries 0..t plus its own ancestors.

Training reproduces that for every t of a sequence at once, unrolled over `steps` draft steps:
- step 0 at t: input (x_{t+1}, f_t), causal attention over step 0's entries 0..t, position t;
- step i at t: input (x_{t+1+i}, step i-1's output at t), position t + i, attending to step 0's
  entries 0..t and to its own chain: steps 1..i at the same t (the "diagonal" of each later step);
- the output of step i at t is trained towards the target's distribution at t + 1 + i (which predicts
  x_{t+2+i}), restricted to the draft vocabulary and renormalised, by cross-entropy (forward KL up to a
  constant), on answer positions whose target argmax the draft vocabulary holds; step i weighs decay**i.
The tokens fed at later steps are the real ones (teacher forcing), the features the draft's own.
The layer itself is engine/models/eagle.py's Eagle3Draft, attending through TTTAttention below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from spec_tools.convert.eagle3_data import Sample


class TTTAttention:
    """Attention backend for the unrolled steps over a padded batch [B, L] (tokens flattened b-major).
    Step 0 attends causally over valid keys; step i at position t attends to step 0's keys 0..t and to
    the keys of steps 1..i at t: one fused attention over [step 0's keys, step 1's, ..., step i's] with
    a causal block followed by diagonal blocks."""

    def __init__(self, key_valid: torch.Tensor):
        B, L = key_valid.shape
        causal = torch.ones(L, L, dtype=torch.bool, device=key_valid.device).tril()
        self.shape = (B, L)
        self.blocks = [(causal[None] & key_valid[:, None, :])[:, None]]            # [B, 1, L, L]
        self.diagonal = torch.eye(L, dtype=torch.bool, device=key_valid.device).expand(B, 1, L, L)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def forward(self, q, k, v, layer, batch, scale, *, window=None, softcap=None, sinks=None):
        if window is not None or softcap is not None or sinks is not None:
            raise ValueError("an EAGLE-3 head trains with full attention: its layer has no sliding window, "
                             "soft-cap or attention sinks")
        B, L = self.shape
        T, heads, dim = q.shape
        q = q.view(B, L, heads, dim).transpose(1, 2)                  # [B, heads, L, dim]
        self.keys.append(k.view(B, L, -1, dim).transpose(1, 2))
        self.values.append(v.view(B, L, -1, dim).transpose(1, 2))
        if len(self.keys) > 1:
            self.blocks.append(self.diagonal)
        out = F.scaled_dot_product_attention(q, torch.cat(self.keys, 2), torch.cat(self.values, 2),
                                             attn_mask=torch.cat(self.blocks, -1), scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(T, heads, dim)


@dataclass
class Batch:
    inputs: torch.Tensor      # [B, L + steps + 1] token ids, 0-padded: step i feeds inputs[:, 1+i : 1+i+L]
    aux: torch.Tensor         # [B, L, 3H] the target's auxiliary hidden states at fed positions
    final: torch.Tensor       # [B, L, H] its final normed hidden states (its distribution via its lm_head)
    key_valid: torch.Tensor   # [B, L] position t was fed
    has_target: torch.Tensor  # [B, L] position j's distribution is a training target (answer, in vocabulary)

    @property
    def tokens(self) -> int:
        return int(self.key_valid.sum())


def collate(samples: Sequence[Sample], steps: int, t2d: torch.Tensor, dtype: torch.dtype, device) -> Batch:
    B, L = len(samples), max(s.fed for s in samples)
    H3, H = samples[0].aux.shape[1], samples[0].final.shape[1]
    inputs = torch.zeros(B, L + steps + 1, dtype=torch.long)
    aux, final = torch.zeros(B, L, H3, dtype=dtype), torch.zeros(B, L, H, dtype=dtype)
    key_valid, has_target = torch.zeros(B, L, dtype=torch.bool), torch.zeros(B, L, dtype=torch.bool)
    for b, s in enumerate(samples):
        n = s.fed
        inputs[b, :n + 1] = s.ids.long()
        aux[b, :n], final[b, :n] = s.aux, s.final
        key_valid[b, :n] = True
        argmax = s.argmax.long()
        # Targets: the prompt's last position onwards (its distribution gives the first answer token).
        known = argmax >= 0
        ok = known & t2d[argmax.clamp(min=0)]
        ok[:max(s.prompt_len - 1, 0)] = False
        has_target[b, :n] = ok
    return Batch(*(x.to(device) for x in (inputs, aux, final, key_valid, has_target)))


@dataclass
class StepStats:
    loss: float
    accuracy: float
    count: int


def unrolled(draft, embed: torch.Tensor, batch: Batch, steps: int) -> Iterator[torch.Tensor]:
    """The draft's output [B, L, H] at every position, step after step (see the module doc)."""
    B, L = batch.key_valid.shape
    h = draft.fc(batch.aux).flatten(0, 1)
    attention = TTTAttention(batch.key_valid)
    positions = torch.arange(L, device=h.device).repeat(B)
    for i in range(steps):
        embeds = F.embedding(batch.inputs[:, 1 + i:1 + i + L], embed).flatten(0, 1)
        h = draft(embeds, h, positions + i, None, attention)
        yield h.view(B, L, -1)


def unrolled_loss(draft, embed: torch.Tensor, head_rows: torch.Tensor, batch: Batch, steps: int,
                  decay: float = 0.8) -> tuple[torch.Tensor, list[StepStats]]:
    """Sum over steps of decay**i * cross-entropy(target distribution, draft distribution).
    `embed`: the target's token embedding; `head_rows`: its lm_head rows for the draft vocabulary."""
    L = batch.key_valid.shape[1]
    with torch.no_grad():
        # The target's distribution at the positions that are targets, and where each one's row is.
        target_probs = (batch.final[batch.has_target] @ head_rows.T).float().softmax(-1)      # [M, V_draft]
        target_top = target_probs.argmax(-1)
        row_of = torch.cumsum(batch.has_target.flatten(), 0).view_as(batch.has_target) - 1
    total = target_probs.new_zeros(())
    stats = []
    for i, h in enumerate(unrolled(draft, embed, batch, steps)):
        # Step i at t learns the target's distribution at j = t + 1 + i.
        targets = batch.has_target[:, 1 + i:]
        count = int(targets.sum())
        if count == 0:
            break
        queries = torch.zeros_like(batch.has_target)
        queries[:, :L - 1 - i] = targets
        rows = row_of[:, 1 + i:][targets]
        logits = draft.lm_head(draft.norm(h[queries])).float()
        loss = -(target_probs[rows] * logits.log_softmax(-1)).sum(-1).mean()
        total = total + decay ** i * loss
        with torch.no_grad():
            accuracy = (logits.argmax(-1) == target_top[rows]).float().mean()
        stats.append(StepStats(loss.item(), accuracy.item(), count))
    return total, stats
