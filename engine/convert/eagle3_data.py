"""On-policy training data for an EAGLE-3 head: the target's answers and its hidden states, on disk.

The target answers each prompt (chat template, greedy or sampled) through the Engine, which keeps
(Engine.capture_hidden_states), for every position the target feeds while generating, the three
auxiliary hidden states the draft reads, the final normed hidden state (its lm_head gives the target's
distribution, the training target) and the argmax where logits are computed (the prompt's last
position and every answer position). Nothing is computed twice: the states come from the generation's
own forwards. The radix cache is off so that every position is computed.

A sample is one conversation of N tokens: ids [N], prompt length P, and per fed position t < N - 1:
aux [N-1, 3H], final [N-1, H] (bfloat16) and argmax [N-1] (-1 where unknown). Samples are written in
shards of `group` prompts (torch.save, read back memory-mapped), listed in manifest.json with what
produced them, so a run that stops resumes at the next shard and a finished set is reused.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from engine.convert import ConvertError
from engine.convert.generate import Generation, chat_prompt_ids, generate_groups
from engine.request import Request

log = logging.getLogger(__name__)

STORE_DTYPE = torch.bfloat16          # wide range (no overflow on outlier features), half the bytes


def take_sample(req: Request) -> Optional[dict]:
    """The finished request's sample from what it captured, or None when it was aborted or its
    positions are incomplete. A prefill from position 0 again (after a retraction) starts over."""
    parts = list(req.captured)
    starts = [p[0] for p in parts]
    if 0 in starts:
        parts = parts[len(starts) - 1 - starts[::-1].index(0):]
    req.captured = []
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
@dataclass(frozen=True)
class DataSpec:
    """What a data directory was made from; a directory made otherwise is not reused."""
    model: str
    aux_layers: tuple[int, ...]
    generation: Generation
    prompts_sha: str
    group: int

    def to_json(self) -> dict:
        return {**asdict(self), "aux_layers": list(self.aux_layers)}


def prompts_digest(prompts: Sequence[str]) -> str:
    return hashlib.sha256("\x00".join(prompts).encode()).hexdigest()[:16]


def generate_data(engine, prompts: Sequence[str], data_dir: Path, spec: DataSpec, *,
                  on_step: Optional[Callable[[int, int], None]] = None) -> list[Path]:
    """Write the shards still missing for `prompts` under data_dir; return every shard in order.
    on_step(new tokens, newly finished prompts) follows the generation; the prompts of shards found
    from an earlier run count as finished at the start."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = data_dir / "manifest.json"
    manifest = {"spec": spec.to_json(), "shards": []}
    if manifest_path.is_file():
        old = json.loads(manifest_path.read_text())
        if old.get("spec") != manifest["spec"]:
            raise ConvertError(f"{data_dir} holds training data made differently (another model, prompt set or "
                               "generation settings); use another directory (--output or --data-dir) or delete it.")
        manifest = old
    done = sum(s["prompts"] for s in manifest["shards"])
    if on_step and done:
        on_step(0, done)
    if done >= len(prompts):
        return [data_dir / s["file"] for s in manifest["shards"]]
    engine.capture_hidden_states(spec.aux_layers)
    ids = chat_prompt_ids(engine.tokenizer, prompts[done:])
    for k, reqs in enumerate(generate_groups(engine, ids, spec.generation, spec.group, first_index=done,
                                             on_step=on_step)):
        samples = [s for s in (take_sample(r) for r in reqs) if s is not None]
        name = f"shard_{len(manifest['shards']):05d}.pt"
        tokens = sum(int(s["ids"].numel()) for s in samples)
        if samples:
            _save_shard(data_dir / name, samples)
        manifest["shards"].append({"file": name, "prompts": len(reqs), "samples": len(samples), "tokens": tokens})
        _write_json(manifest_path, manifest)
    return [data_dir / s["file"] for s in manifest["shards"]]


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


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
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


def load_samples(shards: Sequence[Path]) -> list[Sample]:
    """Every sample, as views into memory-mapped shards (pages are read when a batch uses them)."""
    samples = []
    for path in shards:
        if not Path(path).is_file():
            continue                                 # a shard whose prompts all failed holds nothing
        shard = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        tok = pos = 0
        for n, p in zip(shard["lengths"].tolist(), shard["prompt_lens"].tolist()):
            samples.append(Sample(shard["ids"][tok:tok + n], p, shard["aux"][pos:pos + n - 1],
                                  shard["final"][pos:pos + n - 1], shard["argmax"][pos:pos + n - 1]))
            tok, pos = tok + n, pos + n - 1
    return samples
