"""MTP drafts: a target's own multi-token-prediction layer, run by the EAGLE worker as its draft.

An MTP layer predicts token x_{t+2} from the target's final normed hidden state at t and the token
x_{t+1}, exactly the (feature, next token) pair an EAGLE draft reads, so the EAGLE worker drafts with it
unchanged: `target_features` / `forward(embeds, features, positions, batch, backend)` / `logits`.
forward() returns the layer's final normed output, which is both the lm_head input (the target's
lm_head) and the feature of the next draft step: later steps reuse the first MTP layer recursively
with its own output, as SGLang does. With --enable-multi-layer-eagle (auto for a target with several
MTP layers, as MiMo-V2 has), the first `steps` layers load as MtpLayers and draft step k runs layer k,
each layer reading the target's feature (engine/speculative/eagle.py, MultiLayerMtpDrafter).

Layouts, in the target's checkpoint or in a separate one:
- MiMo (XiaomiMiMo `modeling_mimo.py`, SGLang `mimo_mtp.py`): `model.mtp_layers.{k}.{token_layernorm,
  hidden_layernorm, input_proj [H, 2H] (no bias), <a Qwen2 decoder layer: input_layernorm, self_attn.
  {q,k,v,o}_proj (q/k/v biases), post_attention_layernorm, mlp.*>, final_layernorm}`;
  h = input_proj([hidden_layernorm(feature); token_layernorm(embed)]) with the embedding zeroed at
  position 0 (as SGLang does), then the decoder layer and final_layernorm.
- DeepSeek-style nextn (SGLang `deepseek_nextn.py`): `model.layers.{L}.{enorm, hnorm, eh_proj [H, 2H],
  <a decoder layer's weights>, shared_head.norm}` with L = num_hidden_layers (SGLang's exported
  nextn checkpoints: num_hidden_layers 1 and L = 0); h = eh_proj([enorm(embed); hnorm(feature)]),
  then the decoder layer and shared_head.norm. The layer's `embed_tokens` and `shared_head.head`
  copies are unused: the MTP layer shares both with the target by design. The decoder layer is of the
  config's family: Llama/Qwen-style, or DeepSeek-V3's (MLA attention; an MoE MLP when the layer's
  weights have experts, as DeepSeek-V3's nextn layer does), engine/models/deepseek.py.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from engine.distributed.sharding import local_config
from engine.errors import ConfigError, ModelLoadError
from engine.models import deepseek
from engine.models.eagle import Head, load_draft_weights, target_head
from engine.models.llama import DecoderLayer, RMSNorm, Rotary, is_mtp_weight

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MtpLayout:
    name: str
    marker: re.Pattern              # the input projection's weight; group 1 is the layer's index
    prefix: str                     # the layer's names start with prefix.format(index)
    renames: dict[str, str]         # checkpoint name start -> MtpDraft name start; the rest is the decoder layer's
    unused: tuple[str, ...]         # shared with the target
    hidden_first: bool              # order of the projection's input halves
    mask_first_position: bool


MIMO = MtpLayout(
    "MiMo", re.compile(r"model\.mtp_layers\.(\d+)\.input_proj\.weight"), "model.mtp_layers.{}.",
    {"token_layernorm.": "embed_norm.", "hidden_layernorm.": "hidden_norm.", "input_proj.": "proj.",
     "final_layernorm.": "final_norm."}, (), hidden_first=True, mask_first_position=True)
NEXTN = MtpLayout(
    "nextn", re.compile(r"model\.layers\.(\d+)\.eh_proj\.weight"), "model.layers.{}.",
    {"enorm.": "embed_norm.", "hnorm.": "hidden_norm.", "eh_proj.": "proj.", "shared_head.norm.": "final_norm."},
    ("embed_tokens.", "shared_head.head."), hidden_first=False, mask_first_position=False)
LAYOUTS = (MIMO, NEXTN)


def decoder_layer(config, moe: bool, index: int) -> tuple[nn.Module, int]:
    """The decoder layer inside MTP layer `index` of `config`'s family (its K/V at layer `index` of the
    draft's own pool), and the head dims its rotary turns."""
    if deepseek.uses_mla(config):
        return deepseek.decoder_layer(config, index, moe), config.qk_rope_head_dim
    layer = DecoderLayer(config, index)
    return layer, layer.self_attn.head_dim


class MtpDraft(nn.Module):
    """One MTP layer; forward() returns its final normed output (the next feature and the lm_head input)."""
    aux_layers: tuple[int, ...] = ()
    head: Head          # the target's lm_head (or its FR-Spec rows); set by load_mtp_draft

    def __init__(self, config, layout: MtpLayout, max_positions: int, moe: bool = False, index: int = 0):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.embed_norm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer, rotary_dims = decoder_layer(config, moe, index)
        self.final_norm = RMSNorm(hidden, eps)
        self.rotary = Rotary(config, rotary_dims, max_positions)
        self.hidden_first, self.mask_first_position = layout.hidden_first, layout.mask_first_position

    @property
    def attention(self) -> nn.Module:
        return self.layer.self_attn

    def target_features(self, hidden: torch.Tensor, captured: dict[int, torch.Tensor], rows) -> torch.Tensor:
        return hidden[rows]

    def forward(self, embeds, hidden, positions, batch, backend) -> torch.Tensor:
        if self.mask_first_position:
            embeds = embeds.masked_fill((positions == 0)[:, None], 0)
        e, h = self.embed_norm(embeds), self.hidden_norm(hidden)
        x = self.proj(torch.cat([h, e] if self.hidden_first else [e, h], dim=-1))
        return self.final_norm(self.layer(x, self.rotary(positions, x.dtype), batch, backend))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h)


class MtpLayers(nn.Module):
    """The first MTP layers, for multi-layer drafting: layer k keeps its K/V at layer k of the draft's
    pool and drafts step k; all share the target's lm_head and one rotary table."""
    aux_layers: tuple[int, ...] = ()

    def __init__(self, layers: list[MtpDraft]):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.num_layers = len(layers)
        for layer in layers[1:]:
            layer.rotary = layers[0].rotary

    @property
    def attention(self) -> nn.Module:
        return self.layers[0].attention

    def target_features(self, hidden: torch.Tensor, captured: dict[int, torch.Tensor], rows) -> torch.Tensor:
        return hidden[rows]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.layers[0].head(h)


def load_mtp_draft(source: Path, target: nn.Module, *, own: bool, max_positions: int, dtype: torch.dtype,
                   device: str, hot_ids: Optional[torch.Tensor] = None, num_layers: int = 1) -> nn.Module:
    """The first MTP layer of the checkpoint `source` (the target's own, `own`, or a separate one) as an
    MtpDraft, or its first `num_layers` > 1 as MtpLayers. Only the MTP layers' tensors are read.
    `hot_ids`: an FR-Spec token map restricting the lm_head."""
    from engine.loader import iter_weights, load_config

    config = target.config if own else load_config(source)
    if not own:
        _check_sizes(config, target.config, source)
    layers = config.num_hidden_layers
    # SGLang's exported nextn checkpoints say num_hidden_layers 1 and keep the layer as model.layers.0;
    # with one layer, reading layer 0 as well costs little and the eh_proj marker tells which it is.
    first = 0 if not own and layers == 1 else layers
    tensors = dict(iter_weights(source, select=lambda name: is_mtp_weight(name, first)))
    layout, ids = _find_layers(tensors, config, source, own)
    if len(ids) < num_layers:
        raise ConfigError(f"{source} has {len(ids)} MTP layer(s), but --enable-multi-layer-eagle with "
                          f"--speculative-num-steps {num_layers} runs one layer per step. Lower the steps to "
                          f"{len(ids)} (draft tokens {len(ids) + 1}), or drop the flag to draft every step with the "
                          "first layer.")
    if num_layers == 1 and len(ids) > 1:
        log.info("%s has %d MTP layers; drafting reuses the first one at every step", source, len(ids))
    head = target_head(target, hot_ids, dtype)
    layers = [_load_layer(layout, tensors, index, k, config, source, max_positions, dtype, device, head)
              for k, index in enumerate(ids[:num_layers])]
    return layers[0] if num_layers == 1 else MtpLayers(layers).eval()


def _load_layer(layout: MtpLayout, tensors: dict, index: int, k: int, config, source: Path, max_positions: int,
                dtype: torch.dtype, device: str, head: Head) -> MtpDraft:
    """The checkpoint's MTP layer `index` as the draft's layer k."""
    prefix = layout.prefix.format(index)
    layer = {name[len(prefix):]: tensor for name, tensor in tensors.items() if name.startswith(prefix)}
    renamed = {_rename(rest, layout): t for rest, t in layer.items() if not rest.startswith(layout.unused)}
    with torch.device(device):
        model = MtpDraft(local_config(config, "the MTP layer"), layout, max_positions,
                         moe=any(rest.startswith("mlp.gate.") for rest in layer), index=k)
    load_draft_weights(model, renamed, set(), source)
    model.to(dtype)
    model.rotary.float()
    model.head = head
    return model.eval()


def _find_layers(tensors: dict, config, source: Path, own: bool) -> tuple[MtpLayout, list[int]]:
    """(layout, indices of the MTP layers in order) found by the projection's name."""
    for layout in LAYOUTS:
        ids = sorted(int(m[1]) for name in tensors if (m := layout.marker.fullmatch(name)))
        if ids:
            return layout, ids
    declared = getattr(config, "num_nextn_predict_layers", None) or 0
    if declared:
        raise ModelLoadError(f"{source}/config.json declares {declared} MTP layer(s) (num_nextn_predict_layers) "
                             "but the checkpoint holds no MTP weights (model.mtp_layers.*, or a nextn layer with "
                             "eh_proj after the decoder layers); some conversions drop them. Pass the complete "
                             "checkpoint.")
    if own:
        raise ConfigError(f"The target {source} has no MTP layers (no num_nextn_predict_layers in its config, no "
                          "MTP weights), so --speculative-algorithm MTP has nothing to draft with. Pass "
                          "--speculative-draft-model-path with an MTP (nextn) checkpoint for this model, or use "
                          "--speculative-algorithm EAGLE (with a draft) or NGRAM.")
    raise ConfigError(f"{source} has no MTP layers (model.mtp_layers.*, or a nextn layer with eh_proj). Pass an MTP "
                      "(nextn) checkpoint as --speculative-draft-model-path; for an EAGLE draft use "
                      "--speculative-algorithm EAGLE.")


def _rename(rest: str, layout: MtpLayout) -> str:
    for start, new in layout.renames.items():
        if rest.startswith(start):
            return new + rest[len(start):]
    return "layer." + rest


def _check_sizes(config, target_config, source: Path) -> None:
    for field in ("hidden_size", "vocab_size"):
        got, want = getattr(config, field, None), getattr(target_config, field)
        if got != want:
            raise ConfigError(f"The MTP checkpoint {source} has {field} {got} but the target has {want}: it was "
                              "made for another model. Pass the MTP (nextn) checkpoint of this target.")
