"""What an EAGLE-3 data directory holds and whether a run may use it: manifest.json.

The manifest records the settings the data was made with (DataSpec: target, auxiliary layers,
generation, the target's resolved dtype and weight format) and, per shard of consecutive prompts, how
many prompts it answered, which gave no sample, and a digest of each prompt. A run with the same
settings whose prompts begin with the stored ones may use a prefix of the data or grow it; anything
else is refused, saying what differs. Manifests of the older layout (one digest over the whole prompt
list) are carried over when a run shows it has all their prompts.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

from spec_tools.convert import ConvertError
from spec_tools.convert.generate import Generation

log = logging.getLogger(__name__)


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
    write_manifest(data_dir, manifest)
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


def write_manifest(data_dir: Path, manifest: dict) -> None:
    path = Path(data_dir) / "manifest.json"
    tmp = path.with_suffix(".tmp")                 # replaced whole: an interruption leaves the old one
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(path)
