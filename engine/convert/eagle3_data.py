"""On-policy training data for an EAGLE-3 head: the target's answers and its hidden states, on disk.

The target answers each prompt (chat template, greedy or sampled) through the Engine; a capturing
worker keeps, for every position the target feeds while generating, the three auxiliary hidden states
the draft reads, the final normed hidden state (its lm_head gives the target's distribution, the
training target) and the argmax where logits are computed (the prompt's last position and every
answer position). Nothing is computed twice: the states come from the generation's own forwards. The
radix cache is off so that every position is computed.

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
from engine.worker import PlainWorker

log = logging.getLogger(__name__)

STORE_DTYPE = torch.bfloat16          # wide range (no overflow on outlier features), half the bytes


class _KeepLast:
    """The model runner as the capturing worker sees it: the same, remembering its last forward's output."""

    def __init__(self, runner):
        self.runner, self.last = runner, None

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def forward(self, *args, **kwargs):
        self.last = self.runner.forward(*args, **kwargs)
        return self.last


class CaptureWorker(PlainWorker):
    """Plain decoding that keeps each request's captured states by position (see the module doc)."""

    def __init__(self, runner, eos_ids: Sequence[int], aux_layers: Sequence[int]):
        super().__init__(_KeepLast(runner), eos_ids)
        self.capture_hidden = tuple(aux_layers)
        self.parts: dict[Request, list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self.completed: dict[Request, int] = {}       # prefills completed by the current forward: argmax

    def _keep(self, req: Request, start: int, out, rows: torch.Tensor, argmax: torch.Tensor) -> None:
        if start == 0:                   # a (re-)prefill from scratch: what a retraction left is stale
            self.parts[req] = []
        aux = torch.cat([out.captured[i][rows] for i in self.capture_hidden], dim=-1)
        self.parts[req].append((start, aux.to(STORE_DTYPE).cpu(), out.hidden[rows].to(STORE_DTYPE).cpu(),
                                argmax.to(torch.int32)))

    def sample_next(self, reqs, logits):
        # Called for the requests whose prefill completed, just before after_prefill (and in decode).
        self.completed = {r: int(a) for r, a in zip(reqs, logits.argmax(-1).tolist())}
        return super().sample_next(reqs, logits)

    def after_prefill(self, plan, out) -> None:
        offset = 0
        for req, n in plan:
            argmax = torch.full((n,), -1, dtype=torch.int32)
            if req in self.completed:     # fed every token but the one just sampled; its last row has logits
                end = len(req.all_ids) - 1
                argmax[-1] = self.completed[req]
            else:
                end = req.kv_len
            if not req.finished or req in self.completed:
                self._keep(req, end - n, out, torch.arange(offset, offset + n), argmax)
            offset += n
        self.completed = {}

    def decode(self, reqs: Sequence[Request]) -> list[list[int]]:
        starts = [r.kv_len for r in reqs]
        tokens = super().decode(reqs)
        self.completed = {}
        out = self.runner.last
        argmax = out.logits.argmax(-1)
        for i, (req, start) in enumerate(zip(reqs, starts)):
            self._keep(req, start, out, torch.tensor([i]), argmax[i:i + 1])
        return tokens

    def take(self, req: Request) -> Optional[dict]:
        """The finished request's sample, or None when it was aborted or its positions are incomplete."""
        parts = sorted(self.parts.pop(req, []), key=lambda p: p[0])
        fed = len(req.all_ids) - 1
        if req.finish_reason is None or req.finish_reason.type == "abort" or not parts:
            return None
        if [p[0] for p in parts] != [sum(q[1].shape[0] for q in parts[:k]) for k in range(len(parts))] \
                or sum(p[1].shape[0] for p in parts) != fed:
            log.warning("request %s: captured positions are incomplete; sample skipped", req.rid)
            return None
        return {"ids": torch.tensor(req.all_ids, dtype=torch.int32), "prompt_len": len(req.prompt_ids),
                "aux": torch.cat([p[1] for p in parts]), "final": torch.cat([p[2] for p in parts]),
                "argmax": torch.cat([p[3] for p in parts])}


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
    worker = CaptureWorker(engine.runner, engine.eos_ids, spec.aux_layers)
    engine.worker = engine.scheduler.worker = worker
    ids = chat_prompt_ids(engine.tokenizer, prompts[done:])
    for k, reqs in enumerate(generate_groups(engine, ids, spec.generation, spec.group, first_index=done,
                                             on_step=on_step)):
        samples = [s for s in (worker.take(r) for r in reqs) if s is not None]
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
