"""On-policy training data for an EAGLE-3 head: the target's answers and its hidden states, on disk.

The target answers each prompt (chat template, greedy or sampled) through the Engine, which keeps
(Engine.capture_hidden_states), for every position the target feeds while generating, the three
auxiliary hidden states the draft reads, the final normed hidden state (its lm_head gives the target's
distribution, the training target) and the argmax where logits are computed (the prompt's last
position and every answer position). Nothing is computed twice: the states come from the generation's
own forwards. The radix cache is off so that every position is computed.

A sample is one conversation of N tokens: ids [N], prompt length P, and per fed position t < N - 1:
aux [N-1, 3H], final [N-1, H] (bfloat16) and argmax [N-1] (-1 where unknown). Samples are written in
shards of consecutive prompts (torch.save, read back memory-mapped), listed in manifest.json
(data_manifest.py). A directory grows across runs: a run with more prompts than it holds answers only
the new ones (new shards); one with fewer reads the data of its first prompts; a run that stops
resumes at the next shard.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from spec_tools.convert.data_manifest import prompt_digest, stored_prompts, write_manifest
from spec_tools.convert.generate import Generation, chat_prompt_ids, generate_groups
from engine.core.request import Request

log = logging.getLogger(__name__)

STORE_DTYPE = torch.bfloat16          # wide range (no overflow on outlier features), half the bytes


def captured_sample(req: Request) -> Optional[dict]:
    """The finished request's sample from what it captured, or None when it was aborted or its
    positions are incomplete. A prefill from position 0 again (after a retraction) starts over."""
    parts = req.captured
    starts = [p[0] for p in parts]
    if 0 in starts:
        parts = parts[len(starts) - 1 - starts[::-1].index(0):]
    fed = req.seq_len - 1
    if req.finish_reason is None or req.finish_reason.type == "abort" or not parts:
        return None
    if [p[0] for p in parts] != [sum(q[1].shape[0] for q in parts[:k]) for k in range(len(parts))] \
            or sum(p[1].shape[0] for p in parts) != fed:
        log.warning("request %s: captured positions are incomplete; sample skipped", req.rid)
        return None
    return {"ids": torch.tensor(req.token_ids, dtype=torch.int32), "prompt_len": req.prompt_len,
            "aux": torch.cat([p[1] for p in parts]).to("cpu", STORE_DTYPE),
            "final": torch.cat([p[2] for p in parts]).to("cpu", STORE_DTYPE),
            "argmax": torch.cat([p[3] for p in parts]).to("cpu", torch.int32)}


# ------------------------------------------------------------------------------------------------ writing
def generate_data(engine, prompts: Sequence[str], data_dir: Path, manifest: dict, group: int, *,
                  on_step: Optional[Callable[[int, int], None]] = None) -> dict:
    """Append shards of `group` prompts answering the prompts past those `manifest` (open_data's)
    holds; returns it. on_step(new tokens, newly finished prompts) follows the generation."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    done = stored_prompts(manifest)
    spec = manifest["spec"]
    engine.capture_hidden_states(spec["aux_layers"])
    ids = chat_prompt_ids(engine.tokenizer, prompts[done:])
    for reqs in generate_groups(engine, ids, Generation(**spec["generation"]), group, first_index=done,
                                on_step=on_step):
        taken = [captured_sample(r) for r in reqs]
        samples = [s for s in taken if s is not None]
        name = f"shard_{len(manifest['shards']):05d}.pt"
        if samples:
            _save_shard(data_dir / name, samples)
        first = stored_prompts(manifest)
        manifest["shards"].append({
            "file": name, "prompts": len(reqs), "samples": len(samples),
            "tokens": sum(int(s["ids"].numel()) for s in samples),
            "skipped": [k for k, s in enumerate(taken) if s is None],   # prompts without a sample, by offset
            "digests": [prompt_digest(p) for p in prompts[first:first + len(reqs)]]})
        write_manifest(data_dir, manifest)
    return manifest


def _save_shard(path: Path, samples: list[dict]) -> None:
    shard = {
        "ids": torch.cat([s["ids"] for s in samples]),
        "lengths": torch.tensor([s["ids"].numel() for s in samples], dtype=torch.long),
        "prompt_lens": torch.tensor([s["prompt_len"] for s in samples], dtype=torch.long),
        "aux": torch.cat([s["aux"] for s in samples]),
        "final": torch.cat([s["final"] for s in samples]),
        "argmax": torch.cat([s["argmax"] for s in samples]),
    }
    tmp = path.with_suffix(".tmp")
    torch.save(shard, tmp)
    tmp.replace(path)


# ------------------------------------------------------------------------------------------------ reading
@dataclass
class Sample:
    ids: torch.Tensor          # [N] int32
    prompt_len: int
    aux: torch.Tensor          # [N-1, 3H]
    final: torch.Tensor        # [N-1, H]
    argmax: torch.Tensor       # [N-1] int32

    @property
    def fed(self) -> int:
        return self.aux.shape[0]


def load_samples(shards: Sequence[tuple[Path, int]]) -> list[Sample]:
    """The first `count` samples of each (shard, count), as views into memory-mapped shards (pages are
    read when a batch uses them)."""
    samples = []
    for path, count in shards:
        if not count:
            continue                                 # a shard whose prompts all failed holds nothing
        shard = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        tok = pos = 0
        for n, p in zip(shard["lengths"][:count].tolist(), shard["prompt_lens"][:count].tolist()):
            samples.append(Sample(shard["ids"][tok:tok + n], p, shard["aux"][pos:pos + n - 1],
                                  shard["final"][pos:pos + n - 1], shard["argmax"][pos:pos + n - 1]))
            tok, pos = tok + n, pos + n - 1
    return samples


# ------------------------------------------------------------------------------------------------ checking
HEALTHY_AGREEMENT = 0.9


def answer_agreement(engine, samples: Sequence[Sample], count: int = 8) -> Optional[float]:
    """Mean, over `count` samples spread evenly across `samples` (the last one included), of the share
    of answer positions where the target fed the stored tokens in one forward (Engine.greedy_choices)
    picks the argmax stored there; None when no sample has an answer. Healthy data agrees at nearly
    every position (in bf16 a near-tie may round otherwise in one prefill than in batched decoding);
    data whose requests read the wrong KV agrees far less."""
    fits = min(engine.kv_capacity, engine.context_len)      # a one-request forward over the whole sample
    answered = [s for s in samples if s.prompt_len < s.ids.numel() <= fits]
    if not answered:
        return None
    picks = sorted({round(k * (len(answered) - 1) / max(count - 1, 1)) for k in range(count)})
    shares = []
    for s in (answered[k] for k in picks):
        now = engine.greedy_choices(s.ids.tolist())[s.prompt_len - 1:-1]
        shares.append((now == s.argmax[s.prompt_len - 1:].long()).float().mean().item())
    return sum(shares) / len(shares)
