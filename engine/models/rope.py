"""Rotary position embeddings: each position's rotation frequencies for every RoPE kind a config can name.

A config names its RoPE in transformers 5's `rope_parameters` (a dict per layer type where a family has
several, as Gemma 3) or in transformers 4's `rope_scaling` beside `rope_theta`; `rope_parameters` reads
either into one dict, and the frequencies are computed here, so that both versions' checkpoints and
configs give the same tables (transformers' own init functions read only their version's fields).

Kinds (the `rope_type`): default; linear (positions interpolated by `factor`); llama3 (Llama 3.1's
wavelength bands); yarn (interpolation ramped between two rotation counts, an attention factor);
longrope (Phi-3's per-dimension factors: the short ones up to `original_max_position_embeddings`, the
long ones past it); dynamic (NTK: the base grows with the sequence past `max_position_embeddings`).
Where transformers changes the frequencies with the sequence's length (dynamic, longrope), a position's
are those transformers uses when generating that position token by token: the length is the
position's own plus one. A prompt past that length prefilled at once is rotated otherwise by
transformers (every token at the prompt's length); this engine's rotation of a token never depends on
what else is in its forward (chunked prefill, batching).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from engine.errors import ModelLoadError


def rope_parameters(config, layer_type: Optional[str] = None) -> dict:
    """The config's RoPE parameters as one dict with `rope_type` and `rope_theta` (those of `layer_type`
    where the config keeps a dict per layer type)."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    elif layer_type == "sliding_attention" and getattr(config, "rope_local_base_freq", None):
        # transformers 4's Gemma 3: local layers rotate by their own base, unscaled.
        return {"rope_type": "default", "rope_theta": config.rope_local_base_freq}
    if not params:
        params = getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    kind = params.get("rope_type") or params.pop("type", None) or "default"
    params["rope_type"] = _ALIASES.get(kind, kind)
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    if getattr(config, "original_max_position_embeddings", None):     # transformers 4's Phi-3 kept it outside
        params.setdefault("original_max_position_embeddings", config.original_max_position_embeddings)
    return params


def rotation_angles(params: dict, head_dim: int, positions: int, max_position_embeddings: int
                    ) -> tuple[torch.Tensor, float]:
    """(angles [positions, head_dim // 2]: position p's rotation of each dimension pair, the factor cos
    and sin are scaled by)."""
    kind = params["rope_type"]
    if kind not in _KINDS:
        raise ModelLoadError(f"RoPE type {kind!r} is not supported (supported: {', '.join(_KINDS)}).")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError("partial rotary embeddings (partial_rotary_factor < 1) are not supported.")
    pos = torch.arange(positions, dtype=torch.float32)
    inv_freq, scaling = _KINDS[kind](params, head_dim, pos, max_position_embeddings)
    return pos[:, None] * inv_freq, scaling


def _exponents(head_dim: int) -> torch.Tensor:
    """2i/d for each dimension pair i."""
    return torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim


def _base(params: dict, head_dim: int) -> torch.Tensor:
    """theta^(-2i/d): the unscaled inverse frequency of each dimension pair."""
    return 1.0 / (params["rope_theta"] ** _exponents(head_dim))


def _default(params, head_dim, pos, max_pos):
    return _base(params, head_dim), 1.0


def _linear(params, head_dim, pos, max_pos):
    return _base(params, head_dim) / params["factor"], 1.0


def _llama3(params, head_dim, pos, max_pos):
    inv_freq = _base(params, head_dim)
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    blend = (old / wavelen - low) / (high - low)
    smoothed = (1 - blend) * scaled / factor + blend * scaled
    between = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(between, smoothed, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(params, head_dim, pos, max_pos):
    base, old = params["rope_theta"], params["original_max_position_embeddings"]
    factor = params.get("factor") or max_pos / old
    attention = params.get("attention_factor")
    if attention is None:
        mscale, all_dims = params.get("mscale"), params.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dims) if mscale and all_dims
                     else _yarn_mscale(factor))

    def dimension(rotations: float) -> float:
        """The dimension that turns `rotations` times over the original context."""
        return head_dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(params.get("beta_fast") or 32), dimension(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolated = _base(params, head_dim)
    # Fast dimensions keep their frequency, slow ones are interpolated, the ramp blends between.
    return extrapolated / factor * ramp + extrapolated * (1 - ramp), float(attention)


def _longrope(params, head_dim, pos, max_pos):
    old = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_pos / old
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old))
    base = _base(params, head_dim)
    short = base / torch.tensor(params["short_factor"], dtype=torch.float32)
    long = base / torch.tensor(params["long_factor"], dtype=torch.float32)
    return torch.where((pos + 1 > old)[:, None], long, short), float(attention)


def _dynamic(params, head_dim, pos, max_pos):
    factor = params["factor"]
    length = torch.clamp(pos + 1, min=max_pos)
    base = params["rope_theta"] * ((factor * length / max_pos) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return 1.0 / (base[:, None] ** _exponents(head_dim)), 1.0


# Names older configs gave a kind: Phi-3's first 128k releases called LongRoPE "su".
_ALIASES = {"su": "longrope"}
_KINDS: dict[str, Callable] = {"default": _default, "linear": _linear, "llama3": _llama3, "yarn": _yarn,
                               "longrope": _longrope, "dynamic": _dynamic}
