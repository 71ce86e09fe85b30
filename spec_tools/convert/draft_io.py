"""Import EAGLE / EAGLE-3 drafts from their published layouts, validate them against a target, apply a
token map, and write the layout `spec serve` loads (engine/models/eagle.py).

Layouts read (see tests/eagle_checkpoints.py for tiny examples of each):
- EAGLE repo (EAGLE-1/2): architectures ["LlamaForCausalLM"], one layer, bare names `fc.*`, `layers.0.*`;
- SGLang's EAGLE copies: ["LlamaForCausalLMEagle"], the same names under `model.`, plus the target's lm_head;
- EAGLE-3 (EAGLE repo, SpecForge): ["LlamaForCausalLMEagle3"], `fc`, `midlayer.*`, `norm`, `lm_head`, d2t/t2d;
- vLLM speculators EAGLE-3: `speculators_model_type: eagle3`, the layer config under
  `transformer_layer_config`, the layer as `layers.0.*` (renamed `midlayer.*` here). Only the variant
  the EAGLE-3 architecture computes converts: no norm before the residual or before fc.
Written: config.json plus model.safetensors with bare names (the EAGLE repo's for EAGLE, SpecForge's for
EAGLE-3), without the copies of the target's embedding and (EAGLE) lm_head that the engine takes from
the target. The written directory is loaded by the engine's own loader before it is kept.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from spec_tools.convert import ConvertError
from spec_tools.convert.token_map import eagle3_vocab
from engine.errors import SpecError

EAGLE, EAGLE3 = "EAGLE", "EAGLE3"
_SPECULATORS_UNSUPPORTED = ("norm_before_residual", "norm_before_fc", "fc_norm")


@dataclass
class Draft:
    algorithm: str
    layout: str                                  # where it came from, for the report
    config: dict                                 # the config.json to write
    tensors: dict[str, torch.Tensor]             # bare names, as written
    embedding: Optional[torch.Tensor] = None     # the checkpoint's copy of the target's embedding, if any
    token_map: Optional[list[int]] = None        # EAGLE: an FR-Spec map to serve with
    notes: list[str] = field(default_factory=list)


@dataclass
class Check:
    what: str
    draft: str
    target: str
    status: str                                  # "ok", "warn" or "fail"


# ------------------------------------------------------------------------------------------------ reading
def read_draft(source: str, algorithm: Optional[str] = None) -> Draft:
    """A draft checkpoint (local directory or hub id) in any published layout, normalised."""
    from engine.loader import iter_weights, resolve_model_path

    path = resolve_model_path(source)
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError as exc:
        raise ConvertError(f"{path / 'config.json'} is not valid JSON ({exc}).") from None
    tensors = dict(iter_weights(path))
    if config.get("speculators_model_type") is not None:
        draft = _from_speculators(config, tensors, str(path))
    else:
        draft = _from_eagle_layouts(config, tensors, str(path), algorithm)
    if algorithm is not None and algorithm != draft.algorithm:
        raise ConvertError(f"{source} is an {draft.algorithm} draft ({draft.layout} layout), not {algorithm}; "
                           f"drop --algo or pass --algo {draft.algorithm}.")
    return draft


def _from_eagle_layouts(config: dict, tensors: dict, source: str, algorithm: Optional[str]) -> Draft:
    archs = config.get("architectures") or []
    names = {n[len("model."):] if n.startswith("model.") else n: t for n, t in tensors.items()}
    fc = names.get("fc.weight")
    hidden = config.get("hidden_size")
    if "LlamaForCausalLMEagle3" in archs or (algorithm == EAGLE3 and "midlayer.mlp.down_proj.weight" in names):
        layout = "EAGLE-3 (EAGLE repo / SpecForge)"
        kind = EAGLE3
    elif fc is not None and hidden and tuple(fc.shape) == (hidden, 2 * hidden):
        layout = "SGLang EAGLE" if "LlamaForCausalLMEagle" in archs else "EAGLE repo"
        kind = EAGLE
    else:
        got = f"fc.weight {tuple(fc.shape)}" if fc is not None else "no fc.weight"
        raise ConvertError(f"{source} is not an EAGLE or EAGLE-3 draft (architectures {archs or 'none'}, {got}). "
                           "An ordinary small model drafts with --speculative-algorithm STANDALONE as it is.")
    embedding = names.pop("embed_tokens.weight", None)
    if kind == EAGLE:
        names.pop("lm_head.weight", None)            # SGLang's copy of the target's head
        config = {**config, "architectures": ["LlamaForCausalLMEagle"]}
    else:
        config = {**config, "architectures": ["LlamaForCausalLMEagle3"]}
        if "lm_head.weight" in names:
            config.setdefault("draft_vocab_size", names["lm_head.weight"].shape[0])
    return Draft(kind, layout, config, names, embedding)


def _from_speculators(config: dict, tensors: dict, source: str) -> Draft:
    kind = config.get("speculators_model_type")
    if kind != "eagle3":
        raise ConvertError(f"{source} is a speculators {kind!r} model; only speculators EAGLE-3 drafts convert.")
    odd = [k for k in _SPECULATORS_UNSUPPORTED if config.get(k)]
    if odd:
        raise ConvertError(f"{source} sets {', '.join(odd)}: that EAGLE-3 variant normalises differently from the "
                           "EAGLE-3 architecture spec serves, so it cannot be converted.")
    layer = dict(config.get("transformer_layer_config") or {})
    if not layer.get("hidden_size"):
        raise ConvertError(f"{source}: config.json has no transformer_layer_config with a hidden_size.")
    out = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1}
    for key in ("draft_vocab_size", "target_hidden_size"):
        if config.get(key) is not None:
            out[key] = config[key]
    if config.get("eagle_aux_hidden_state_layer_ids") is not None:
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(config["eagle_aux_hidden_state_layer_ids"])}
    names = {("midlayer." + n[len("layers.0."):] if n.startswith("layers.0.") else n): t for n, t in tensors.items()}
    embedding = names.pop("embed_tokens.weight", None)
    if "lm_head.weight" in names:
        out.setdefault("draft_vocab_size", names["lm_head.weight"].shape[0])
    return Draft(EAGLE3, "vLLM speculators EAGLE-3", out, names, embedding)


# ------------------------------------------------------------------------------------------------ token maps
def apply_token_map(draft: Draft, ids: Sequence[int], vocab_size: int) -> None:
    """EAGLE-3: the draft vocabulary becomes the map's ids that the draft's head has rows for (d2t/t2d
    rebuilt, lm_head rows picked). EAGLE: the map is written beside the draft, to serve with
    --speculative-token-map (the engine restricts the target's lm_head to it when it loads)."""
    if draft.algorithm == EAGLE:
        draft.token_map = [int(i) for i in ids]
        draft.notes.append(f"token map of {len(ids)} ids saved as token_map.pt: serve with "
                           "--speculative-token-map <output>/token_map.pt")
        return
    head = draft.tensors.get("lm_head.weight")
    if head is None:
        raise ConvertError("This EAGLE-3 draft has no lm_head of its own (it drafts with the target's); a token "
                           "map cannot pick its rows. Serve it as it is.")
    current = _draft_ids(draft)
    row_of = {int(t): r for r, t in enumerate(current.tolist())}
    wanted = [int(i) for i in ids if int(i) in row_of]
    if not wanted:
        raise ConvertError("None of the token map's ids is in this draft's vocabulary; pass a map built for this "
                           "target's tokenizer.")
    target_ids, d2t, t2d = eagle3_vocab(wanted, vocab_size)
    draft.tensors["lm_head.weight"] = head[torch.tensor([row_of[int(t)] for t in target_ids])].contiguous()
    draft.tensors["d2t"], draft.tensors["t2d"] = d2t, t2d
    draft.config["draft_vocab_size"] = len(target_ids)
    dropped = len(ids) - len(wanted)
    left_out = f" ({dropped} map ids are not in the draft's vocabulary and were left out)" if dropped else ""
    draft.notes.append(f"draft vocabulary {len(current)} -> {len(target_ids)} tokens{left_out}")


def _draft_ids(draft: Draft) -> torch.Tensor:
    """Target id of each row of an EAGLE-3 draft's lm_head."""
    rows = draft.tensors["lm_head.weight"].shape[0]
    d2t = draft.tensors.get("d2t")
    return torch.arange(rows) + (d2t.long() if d2t is not None else 0)


# ------------------------------------------------------------------------------------------------ validation
def validate(draft: Draft, target_config, target_embedding: Optional[torch.Tensor]) -> list[Check]:
    """What a reader needs to trust the draft for this target: sizes, vocabulary, layer ids, embedding."""
    cfg, checks = draft.config, []
    hidden = target_config.hidden_size
    for key in ("hidden_size", "target_hidden_size"):
        if cfg.get(key) is not None:
            checks.append(Check(key.replace("_", " "), str(cfg[key]), str(hidden), _ok(cfg[key] == hidden)))
    fc = draft.tensors.get("fc.weight")
    width = 2 if draft.algorithm == EAGLE else 3
    checks.append(Check("fc input width", str(None if fc is None else fc.shape[1]), f"{width} x {hidden}",
                        _ok(fc is not None and fc.shape[1] == width * hidden)))
    vocab = target_config.vocab_size
    if cfg.get("vocab_size") is not None:
        same = cfg["vocab_size"] == vocab
        checks.append(Check("vocab size", str(cfg["vocab_size"]), str(vocab), "ok" if same else "warn"))
    if draft.algorithm == EAGLE3:
        checks += _eagle3_checks(draft, target_config)
    if draft.embedding is not None and target_embedding is not None:
        same = draft.embedding.shape == target_embedding.shape and torch.allclose(
            draft.embedding.float(), target_embedding.float(), rtol=1e-2, atol=1e-3)
        checks.append(Check("embedding copy", "same as the target's" if same else "differs",
                            f"{tuple(target_embedding.shape)}", "ok" if same else "warn"))
    return checks


def _eagle3_checks(draft: Draft, target_config) -> list[Check]:
    from engine.models.eagle import eagle3_aux_layers

    checks = []
    layers = target_config.num_hidden_layers
    try:
        aux = eagle3_aux_layers(_namespace(draft.config), layers, "draft")
        checks.append(Check("aux hidden states (HF indices)", str(list(aux)), f"{layers} layers", "ok"))
    except SpecError as exc:
        checks.append(Check("aux hidden states", str(exc), f"{layers} layers", "fail"))
    head = draft.tensors.get("lm_head.weight")
    if head is not None:
        ids = _draft_ids(draft)
        inside = bool(((ids >= 0) & (ids < target_config.vocab_size)).all())
        checks.append(Check("draft vocabulary", f"{len(ids)} tokens, ids {int(ids.min())}..{int(ids.max())}",
                            f"vocabulary of {target_config.vocab_size}", _ok(inside)))
        t2d = draft.tensors.get("t2d")
        if t2d is not None and inside:
            agree = (t2d.numel() == target_config.vocab_size
                     and torch.equal(t2d.bool().nonzero().flatten(), ids.sort().values))
            checks.append(Check("t2d agrees with d2t", "yes" if agree else "no", "", "ok" if agree else "warn"))
    return checks


def _ok(good: bool) -> str:
    return "ok" if good else "fail"


def _namespace(config: dict):
    import types

    return types.SimpleNamespace(**config)


# ------------------------------------------------------------------------------------------------ writing
class _ConfigOnly:
    """Stands in for the target when the engine's loader checks a written draft: the loader reads the
    target's config; the lm_head it would borrow is never called here."""

    def __init__(self, config):
        self.config = config

    def compute_logits(self, hidden):
        raise AssertionError("not called while checking")


def write_draft(draft: Draft, output: Path, target_config) -> Path:
    """Write the draft, load it with the engine's loader against the target's config, then move it into
    place (an existing output is replaced only after the check passed)."""
    from safetensors.torch import save_file

    from engine.models.eagle import load_eagle_draft

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}-"))
    try:
        (tmp / "config.json").write_text(json.dumps(draft.config, indent=2, default=str))
        save_file({n: t.contiguous() for n, t in draft.tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        if draft.token_map is not None:
            torch.save(draft.token_map, tmp / "token_map.pt")
        load_eagle_draft(draft.algorithm, tmp, _ConfigOnly(target_config), max_positions=16,
                         dtype=torch.float32, device="cpu")
        if output.exists():
            shutil.rmtree(output)
        tmp.rename(output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output
