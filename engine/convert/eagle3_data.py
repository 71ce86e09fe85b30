"""On-policy training data for an EAGLE-3 head: the target's answers and its hidden states, on disk.

The target answers each prompt (chat template, greedy or sampled) through the Engine, which keeps
(Engine.capture_hidden_states), for every position the target feeds while generating, the three
auxiliary hidden states the draft reads, the final normed hidden state (its lm_head gives the target's
distribution, the training target) and the argmax where logits are computed (the prompt's last
position and every answer position). Nothing is computed twice: the states come from the generation's
own forwards. The radix cache is off so that every position is computed.

A sample is one conversation of N tokens: ids [N], prompt length P, and per fed position t < N - 1:
aux [N-1, 3H], final [N-1, H] (bfloat16) and argmax [N-1] (-1 where unknown). Samples are written in
shards of consecutive prompts (torch.save, read back memory-mapped), listed in manifest.json with the
settings that produced them (DataSpec) and a digest of every prompt a shard answered.

A directory grows across runs: a run with more prompts than it holds answers only the new ones (new
shards); a run with fewer uses the data of its first prompts. Both hold only when the run's prompts
begin with the stored ones (checked prompt by prompt, by content) and the settings are the same; a
run that stops resumes at the next shard.
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
    """The settings a data directory was made with: data made otherwise is neither reused nor grown.
    dtype and quantization are the target's as resolved (what its hidden states were computed in)."""
    model: str
    aux_layers: tuple[int, ...]
    generation: Generation
    dtype: str
    quantization: str

    def to_json(self) -> dict:
        return {**asdict(self), "aux_layers": list(self.aux_layers)}


def prompt_digest(prompt: str) -> str:
    return hashlib.sha256(prompt.encode()).hexdigest()[:12]


def check_settings(data_dir: Path, spec: DataSpec) -> Optional[dict]:
    """The directory's manifest, or None when it has none; a ConvertError when it was made with
    settings other than `spec`'s (checked before anything costly, e.g. magpie writing prompts). A
    manifest in the older layout records too little to tell: open_data carries it over first."""
    path = Path(data_dir) / "manifest.json"
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConvertError(f"{path} is not valid JSON ({exc.msg}); the data there cannot be trusted: delete "
                           f"{data_dir} or pass another --data-dir.") from None
    if "prompts_sha" in manifest.get("spec", {}):
        return manifest
    stored, wanted = _flat(manifest.get("spec", {})), _flat(spec.to_json())
    differ = [k for k in wanted if stored.get(k) != wanted[k]]
    if differ:
        raise ConvertError(f"{data_dir} holds data generated with other settings: "
                           + "; ".join(f"{k} {stored.get(k)!r} there, {wanted[k]!r} now" for k in differ)
                           + ". Pass the settings it was made with to reuse or grow it, or another --data-dir "
                             "(or delete it) for new data.")
    return manifest


def open_data(data_dir: Path, spec: DataSpec, prompts: Sequence[str]) -> dict:
    """The directory's manifest (a new, empty one when there is none), once its settings are `spec`'s
    and its prompts and `prompts` begin alike; a ConvertError saying what differs otherwise."""
    manifest = check_settings(data_dir, spec)
    if manifest is None:
        return {"spec": spec.to_json(), "shards": []}
    if "prompts_sha" in manifest["spec"]:
        manifest = _upgraded(data_dir, manifest, spec, prompts)
    digests = [d for s in manifest["shards"] for d in s["digests"]]
    for i, (prompt, digest) in enumerate(zip(prompts, digests)):
        if prompt_digest(prompt) != digest:
            raise ConvertError(f"{data_dir} was made from other prompts: prompt {i + 1} of this run is not the one it "
                               f"answered (first words now: {prompt[:60]!r}). Data grows only when the prompt list "
                               "begins with the stored one: pass the --prompts sources of the run that made it, in "
                               "the same order, or another --data-dir.")
    return manifest


def _upgraded(data_dir: Path, manifest: dict, spec: DataSpec, prompts: Sequence[str]) -> dict:
    """A manifest written before data could grow (one digest over all its prompts, no record of the
    target's format), given per-prompt digests when this run's prompts begin with all of its prompts.
    Its format is taken to be this run's: the same resolution of the same options on the same machine."""
    old = manifest["spec"]
    done = sum(s["prompts"] for s in manifest["shards"])
    common = {k: v for k, v in spec.to_json().items() if k in old}
    # Its digest covers the prompts its run asked for, maybe more than it answered before stopping.
    made_for = {digest for n, digest in _joined_digests(prompts) if n >= done}
    if {k: old[k] for k in common} != common or old["prompts_sha"] not in made_for \
            or any(s["samples"] != s["prompts"] for s in manifest["shards"]):
        raise ConvertError(f"{data_dir} was written by an older spec, which kept one digest for all its prompts: it "
                           "can be carried over only by a run with the same settings whose prompts begin with all "
                           "those it was made for (the same --prompts, -n at least as large), and only if every "
                           "prompt has its sample. Otherwise delete it or pass another --data-dir.")
    first = 0
    for shard in manifest["shards"]:
        shard.update(skipped=[], digests=[prompt_digest(p) for p in prompts[first:first + shard["prompts"]]])
        first += shard["prompts"]
    manifest["spec"] = spec.to_json()
    _write_json(Path(data_dir) / "manifest.json", manifest)
    log.warning("%s: carried over from an older spec's layout (its prompts are this run's first %d)", data_dir, done)
    return manifest


def _joined_digests(prompts: Sequence[str]):
    """(n, the older layout's digest of the first n prompts) for every n."""
    h = hashlib.sha256()
    for n, prompt in enumerate(prompts, 1):
        h.update((prompt if n == 1 else "\x00" + prompt).encode())
        yield n, h.hexdigest()[:16]


def _flat(spec: dict) -> dict:
    """The generation settings beside the others, so that an error names the one that differs."""
    return {**{k: v for k, v in spec.items() if k != "generation"}, **spec.get("generation", {})}


def stored_prompts(manifest: dict) -> int:
    return sum(s["prompts"] for s in manifest["shards"])


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
        taken = [take_sample(r) for r in reqs]
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
        _write_json(data_dir / "manifest.json", manifest)
    return manifest


def data_shards(data_dir: Path, manifest: dict, num_prompts: int) -> list[tuple[Path, int]]:
    """(shard, samples to read from its start) covering the first `num_prompts` prompts."""
    out, covered = [], 0
    for shard in manifest["shards"]:
        if covered >= num_prompts:
            break
        take = min(shard["prompts"], num_prompts - covered)
        path, count = Path(data_dir) / shard["file"], take - sum(k < take for k in shard["skipped"])
        if count and not path.is_file():
            raise ConvertError(f"{path} is missing though {data_dir}/manifest.json lists it; delete {data_dir} "
                               "(or pass another --data-dir) to generate the data again.")
        out.append((path, count))
        covered += shard["prompts"]
    return out


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
