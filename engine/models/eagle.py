"""EAGLE draft models (EAGLE-1/2 and EAGLE-3), loaded from their published checkpoints as they are.

EAGLE-1/2 (SafeAILab/EAGLE `cnets1.py`; SGLang `LlamaForCausalLMEagle`): one Llama decoder layer fed
    fc([embed(x_{t+1}); f_t]) (fc [H, 2H], bias when the checkpoint has one), where f_t is the target's
    final normed hidden state at position t, or the draft's own output for drafted tokens. The layer
    skips its input norm and there is no final norm: the target's lm_head reads the layer output as is.
    Checkpoint names: `fc.*`, `layers.0.{self_attn,mlp,post_attention_layernorm}.*` (EAGLE repo,
    pytorch_model.bin), or the same under `model.` (SGLang's copies, which may add `lm_head.weight`).
EAGLE-3 (EAGLE `cnets.py`; SGLang `LlamaForCausalLMEagle3`): fc [H, 3H] (no bias) projects three
    target hidden states; the `midlayer` normalises the embedding (input_layernorm) and the hidden
    (hidden_norm) separately and attends over their concatenation [2H]; `norm` + its own `lm_head`
    [draft_vocab, H] give logits over a reduced vocabulary, draft id d being target id d + d2t[d].
    Later draft steps feed the midlayer's pre-norm output instead of fc(aux).
Both take the token embedding from the target (a checkpoint's `embed_tokens.weight` copy is unused).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from engine.distributed import group as tp
from engine.distributed.sharding import local_config, local_rows, local_weights
from engine.errors import ConfigError, ModelLoadError
from engine.models.llama import MLP, Attention, DecoderLayer, RMSNorm, Rotary, fuse_weights
from engine.speculative.token_map import HotVocabHead

EAGLE_ARCHITECTURES = ("LlamaForCausalLM", "LlamaForCausalLMEagle")
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3",)
_NOT_A_DRAFT = "For an ordinary small model as the draft use --speculative-algorithm STANDALONE."


class DraftVocabHead(HotVocabHead):
    """EAGLE-3's own lm_head: its row d is target token d + d2t[d] (the rows are given, not picked)."""

    def __init__(self, weight: torch.Tensor, ids: torch.Tensor, vocab_size: int):
        self._use(weight.detach(), ids.to(weight.device), vocab_size, tp.building())    # sharded: a block of rows


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _set_qkv(attn: Attention, in_features: int, bias: bool) -> None:
    """Give the fused q/k/v projection the draft's input width and the checkpoint's bias."""
    attn.qkv_proj = nn.Linear(in_features, attn.qkv_proj.out_features, bias=bias)


# hidden [N, H] -> fp32 logits [N, target vocab], -inf for tokens the draft cannot propose.
Head = Callable[[torch.Tensor], torch.Tensor]


class EagleDraft(nn.Module):
    """EAGLE-1/2 draft. forward() returns the layer output: the next step's feature and the lm_head input."""
    aux_layers: tuple[int, ...] = ()
    head: Head        # the target's lm_head, or its FR-Spec rows; set by load_eagle_draft

    def __init__(self, config, max_positions: int, fc_bias: bool, qkv_bias: bool):
        super().__init__()
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        layer = DecoderLayer(config, 0)
        layer.input_layernorm = nn.Identity()       # EAGLE's first layer has no input norm
        _set_qkv(layer.self_attn, hidden, qkv_bias)
        self.layers = nn.ModuleList([layer])
        self.rotary = Rotary(config, _head_dim(config), max_positions)

    @property
    def attention(self) -> Attention:
        return self.layers[0].self_attn

    def target_features(self, hidden: torch.Tensor, captured: dict[int, torch.Tensor], rows) -> torch.Tensor:
        return hidden[rows]

    def forward(self, embeds, hidden, positions, batch, backend) -> torch.Tensor:
        h = self.fc(torch.cat([embeds, hidden], dim=-1))
        return self.layers[0](h, self.rotary(positions, h.dtype), batch, backend)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h)


class Eagle3Layer(nn.Module):
    def __init__(self, config, qkv_bias: bool):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config, 0)
        _set_qkv(self.self_attn, 2 * hidden, qkv_bias)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.tp = tp.building()

    def forward(self, embeds, h, rope, batch, backend) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(h)], dim=-1)
        h = h + tp.all_reduce(self.self_attn(x, rope, batch, backend), self.tp)
        return h + tp.all_reduce(self.mlp(self.post_attention_layernorm(h)), self.tp)


class Eagle3Draft(nn.Module):
    """EAGLE-3 draft. forward() returns the pre-norm output (the next step's hidden input)."""
    head: Head        # its own lm_head mapped by d2t, or the target's when it has none; set by load_eagle_draft

    def __init__(self, config, aux_layers: tuple[int, ...], max_positions: int, fc_bias: bool,
                 qkv_bias: bool, draft_vocab: Optional[int]):
        super().__init__()
        hidden = config.hidden_size
        self.aux_layers = aux_layers
        self.fc = nn.Linear(len(aux_layers) * hidden, hidden, bias=fc_bias)
        self.midlayer = Eagle3Layer(config, qkv_bias)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        # Without its own head (draft vocab = target vocab) the target's lm_head serves.
        self.lm_head = nn.Linear(hidden, local_rows(draft_vocab), bias=False) if draft_vocab else None
        self.rotary = Rotary(config, _head_dim(config), max_positions)

    @property
    def attention(self) -> Attention:
        return self.midlayer.self_attn

    def target_features(self, hidden: torch.Tensor, captured: dict[int, torch.Tensor], rows) -> torch.Tensor:
        return self.fc(torch.cat([captured[i][rows] for i in self.aux_layers], dim=-1))

    def forward(self, embeds, hidden, positions, batch, backend) -> torch.Tensor:
        return self.midlayer(embeds, hidden, self.rotary(positions, hidden.dtype), batch, backend)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(h))


# ------------------------------------------------------------------------------------------------
def load_eagle_draft(algorithm: str, draft_dir: Path, target: nn.Module, *, max_positions: int,
                     dtype: torch.dtype, device: str, hot_ids: Optional[torch.Tensor] = None) -> nn.Module:
    """Check the draft's config against the target, read its tensors, check them, build and load it.
    `hot_ids` (EAGLE only): an FR-Spec token map restricting the lm_head to those tokens."""
    from engine.loader import iter_weights, load_config

    config = load_config(draft_dir)
    target_config = target.config
    source = str(draft_dir)
    _check_config(algorithm, config, target_config, source)
    aux = eagle3_aux_layers(config, target_config.num_hidden_layers, source) if algorithm == "EAGLE3" else ()
    tensors = {_strip_prefix(name): t for name, t in iter_weights(draft_dir)}
    fc = tensors.get("fc.weight")
    width = 2 if algorithm == "EAGLE" else 3
    if fc is None or tuple(fc.shape) != (config.hidden_size, width * config.hidden_size):
        got = "no fc.weight" if fc is None else f"fc.weight of shape {tuple(fc.shape)}"
        raise ModelLoadError(f"{source} has {got}; an {algorithm} draft has fc.weight "
                             f"[{config.hidden_size}, {width * config.hidden_size}]. {_NOT_A_DRAFT}")
    layer = "layers.0" if algorithm == "EAGLE" else "midlayer"
    fc_bias, qkv_bias = "fc.bias" in tensors, f"{layer}.self_attn.q_proj.bias" in tensors
    ignored = {"embed_tokens.weight", "d2t", "t2d"}    # d2t is read by _draft_vocab
    vocab = target_config.vocab_size
    rows = ids = None
    local = local_config(config, "the draft")          # this rank's block (engine/distributed/sharding.py)
    if algorithm == "EAGLE":
        ignored.add("lm_head.weight")               # the target's lm_head is the draft's (as in SGLang)
        with torch.device(device):
            model = EagleDraft(local, max_positions, fc_bias, qkv_bias)
    else:
        rows, ids = _draft_vocab(tensors, config, vocab, source)
        with torch.device(device):
            model = Eagle3Draft(local, aux, max_positions, fc_bias, qkv_bias, rows)
    load_draft_weights(model, tensors, ignored, source)
    model.to(dtype)
    model.rotary.float()
    if getattr(model, "lm_head", None) is not None:
        model.head = DraftVocabHead(model.lm_head.weight, torch.arange(rows) if ids is None else ids, vocab)
    else:
        model.head = target_head(target, hot_ids, dtype)
    return model.eval()


def target_head(target: nn.Module, hot_ids: Optional[torch.Tensor], dtype: torch.dtype) -> Head:
    """The target's lm_head, restricted to an FR-Spec token map's rows (in `dtype`) when one is given."""
    if hot_ids is None:
        return target.compute_logits
    return HotVocabHead(target.lm_head_weight(), hot_ids, target.config.vocab_size, dtype)


def _strip_prefix(name: str) -> str:
    # SGLang's renamed copies put the EAGLE repo's names under `model.`.
    return name[len("model."):] if name.startswith("model.") else name


def _check_config(algorithm: str, config, target_config, source: str) -> None:
    archs = list(getattr(config, "architectures", None) or [])
    expected, other = ((EAGLE_ARCHITECTURES, EAGLE3_ARCHITECTURES) if algorithm == "EAGLE"
                       else (EAGLE3_ARCHITECTURES, EAGLE_ARCHITECTURES))
    if not any(a in expected for a in archs):
        if any(a in other for a in archs):
            hint = "EAGLE3" if algorithm == "EAGLE" else "EAGLE"
            raise ConfigError(f"{source} is an {hint} draft ({', '.join(archs)}); pass "
                              f"--speculative-algorithm {hint}.")
        raise ModelLoadError(f"{source}: architecture {', '.join(archs) or 'none'} is not an {algorithm} draft; "
                             f"expected one of {', '.join(expected)}.")
    layers = getattr(config, "num_hidden_layers", None)
    if layers != 1:
        raise ModelLoadError(f"{source}: {algorithm} drafts have one decoder layer; its config says "
                             f"num_hidden_layers={layers}. {_NOT_A_DRAFT}")
    target_hidden = target_config.hidden_size
    sizes = (config.hidden_size, getattr(config, "target_hidden_size", None))
    bad = [h for h in sizes if h not in (None, target_hidden)]
    if bad:
        raise ConfigError(f"The draft {source} has hidden size {bad[0]} but the target has {target_hidden}: "
                          f"this draft was trained for another model. Pass the {algorithm} draft made for "
                          "this target.")


def eagle3_aux_layers(config, target_layers: int, source: str) -> tuple[int, ...]:
    """The target hidden states EAGLE-3 reads, as indices in HF's hidden_states (i = input of layer i).
    A checkpoint's `eagle_aux_hidden_state_layer_ids` name layer outputs (index = id + 1); without
    them SGLang's default (2, L // 2, L - 3) applies."""
    nested = getattr(config, "eagle_config", None) or {}
    ids = nested.get("eagle_aux_hidden_state_layer_ids") or getattr(config, "eagle_aux_hidden_state_layer_ids", None)
    if ids is not None:
        if len(ids) != 3 or not all(isinstance(i, int) and 0 <= i < target_layers for i in ids):
            raise ConfigError(f"{source}: eagle_aux_hidden_state_layer_ids {list(ids)} must be 3 layer ids "
                              f"below the target's {target_layers} layers.")
        return tuple(i + 1 for i in ids)
    if target_layers < 3:
        raise ConfigError(f"The target has {target_layers} layers; EAGLE-3's default aux layers (2, L//2, L-3) "
                          f"need at least 3. Set eagle_aux_hidden_state_layer_ids in {source}/config.json.")
    return (2, target_layers // 2, target_layers - 3)


def _draft_vocab(tensors: dict, config, vocab: int, source: str) -> tuple[Optional[int], Optional[torch.Tensor]]:
    """(rows of the draft's own lm_head or None when it has none, target id of each row (d + d2t[d]) or
    None when the rows are the target vocabulary in order)."""
    head = tensors.get("lm_head.weight")
    d2t = tensors.get("d2t")
    if head is None:
        if d2t is not None or getattr(config, "draft_vocab_size", None) not in (None, vocab):
            raise ModelLoadError(f"{source} maps a draft vocabulary (d2t / draft_vocab_size) but has no "
                                 "lm_head.weight. Pass the complete EAGLE3 checkpoint.")
        return None, None
    rows = head.shape[0]
    declared = getattr(config, "draft_vocab_size", None)
    if declared is not None and declared != rows:
        raise ModelLoadError(f"{source}: lm_head.weight has {rows} rows but draft_vocab_size is {declared}.")
    if d2t is None:
        if rows != vocab:
            raise ModelLoadError(f"{source}: its lm_head covers {rows} tokens, not the target's {vocab}, "
                                 "and it has no d2t mapping them to target ids.")
        return rows, None
    if tuple(d2t.shape) != (rows,):
        raise ModelLoadError(f"{source}: d2t has shape {tuple(d2t.shape)}; expected ({rows},), one offset "
                             "per draft token.")
    ids = torch.arange(rows) + d2t.long()
    bad = ((ids < 0) | (ids >= vocab)).nonzero()
    if bad.numel():
        d = int(bad[0])
        raise ConfigError(f"{source}: d2t maps draft token {d} to target id {int(ids[d])}, outside the target "
                          f"vocabulary of {vocab}: this draft was made for another target model.")
    return rows, ids


def load_draft_weights(model: nn.Module, tensors: dict[str, torch.Tensor], ignored: set[str], source: str) -> None:
    """Copy named tensors (q/k/v and gate/up fused here) into the draft; every parameter must be given."""
    params = dict(model.named_parameters())
    loaded = set()
    for name, tensor in fuse_weights(local_weights(tensors.items()), {}):
        if name in ignored or "rotary_emb" in name:
            continue
        param = params.get(name)
        if param is None:
            raise ModelLoadError(f"{source}: unexpected weight {name!r} for this draft architecture.")
        if param.shape != tensor.shape:
            raise ModelLoadError(f"{source}: {name} has shape {tuple(tensor.shape)}, the config implies "
                                 f"{tuple(param.shape)}.")
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelLoadError(f"{source} lacks {len(missing)} draft weights, e.g. {missing[:3]}. "
                             "Pass a complete checkpoint.")
