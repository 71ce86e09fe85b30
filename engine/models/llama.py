"""Llama-family decoder (Llama 2/3/3.1, SmolLM2, Mistral, Qwen2/2.5, Qwen3) over a paged KV cache.

The model sees token ids, positions and a ForwardBatch; attention goes through the backend, so the
same code runs prefill, decode and tree verification. Parameter names follow the Hugging Face
checkpoints, except that q/k/v and gate/up projections are fused (one matmul each) at load time.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend
from engine.distributed import group as tp
from engine.distributed.sharding import local_weights
from engine.core.forward_batch import ForwardBatch
from engine.loader.fp8_quant import cat_rows
from engine.models import fused_decode
from engine.models.prepack import PrepackedLinear, prepack_linears
from engine.models.rope import rope_parameters, rotation_angles
from spec_kernels import cpu_elementwise


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel computes transformers' x * rsqrt(mean(x^2) + eps) bit for bit, in one op
        # instead of seven; low precision is normalised in fp32 and scaled after rounding, as there.
        # bf16 on the CPU: the same steps in one C call (kernels/cpu_elementwise.c).
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        if self.weight.dtype == x.dtype and cpu_elementwise.usable(x):
            return cpu_elementwise.rms_norm(x, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class Rotary(nn.Module):
    """cos/sin tables for every position, computed once (engine/models/rope.py: every RoPE kind, read
    from transformers 4 and 5 configs alike); `layer_type` picks a family's per-layer-type RoPE."""

    def __init__(self, config, head_dim: int, max_positions: int, layer_type: str | None = None):
        super().__init__()
        self.config, self.head_dim, self.max_positions, self.layer_type = config, head_dim, max_positions, layer_type
        self.build(torch.empty(0).device)

    def build(self, device) -> None:
        """(Re)compute the tables onto `device`: a model built on the meta device calls it once the
        device is known (engine/core/model_runner.py: materialize)."""
        config, head_dim = self.config, self.head_dim
        with torch.device("cpu"):       # computed on the CPU whatever the device, then moved there
            params = rope_parameters(config, self.layer_type)
            angles, scaling = rotation_angles(params, head_dim, self.max_positions,
                                              getattr(config, "max_position_embeddings", None) or self.max_positions)
            emb = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(device), persistent=False)
        # rotate_half(x) * sin = roll(x, half) * (sin with its first half negated): the same products,
        # bit for bit, in one op instead of four.
        sin = emb.sin() * scaling
        sin[:, :head_dim // 2].neg_()
        self.register_buffer("signed_sin", sin.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens' (cos, sin) [T, 1, head_dim], gathered once per forward for every layer."""
        return self.cos[positions].to(dtype)[:, None, :], self.signed_sin[positions].to(dtype)[:, None, :]


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] (queries and keys together) by the tokens' (cos, sin)."""
    cos, sin = rope
    if cos.dtype == x.dtype and cpu_elementwise.usable(x):
        return cpu_elementwise.rope(x, cos, sin)
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def sliding_window(config, layer: int) -> int | None:
    """The layer's sliding window (None: it attends to everything), as transformers reads it: by
    `layer_types` where the config lists them (Gemma's local layers, Qwen2's upper layers), else every
    layer's where the config names one (Mistral v0.1, Phi-3). transformers 4's Qwen2 configs list no
    types: `use_sliding_window` from `max_window_layers` on."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:       # a layer past them (a draft's, an MTP layer's) attends to everything
        return window if layer < len(types) and types[layer] == "sliding_attention" else None
    if config.model_type in ("qwen2", "qwen3", "mimo"):
        on = getattr(config, "use_sliding_window", False) and layer >= getattr(config, "max_window_layers", 0)
        return window if on else None
    return window


class Attention(nn.Module):
    def __init__(self, config, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        # Qwen2 (and MiMo and Qwen2-MoE, built on it) has q/k/v biases only, whatever attention_bias says
        # (MiMo's config says true); Llama's attention_bias puts one on o_proj too.
        qwen2 = config.model_type in ("qwen2", "mimo", "qwen2_moe")
        bias = bool(getattr(config, "attention_bias", False)) and not qwen2
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, q + 2 * kv, bias=bias or qwen2)
        self.o_proj = nn.Linear(q, config.hidden_size, bias=bias)
        self.split = (q, kv, kv)       # rows of q, k and v in the fused projection
        self.qk_norm = config.model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = self.head_dim ** -0.5
        self.window = sliding_window(config, layer)
        self.softcap: float | None = None       # a logit soft-cap: set by families that have one
        self.sinks: torch.Tensor | None = None  # a sink logit per head [H]: set by families that have them

    def forward(self, x, rope, batch: ForwardBatch, backend: AttentionBackend):
        T = x.shape[0]
        qk, v = self.project(x)
        q, k = rotate(qk, rope).split((self.num_heads, self.num_kv_heads), dim=1)
        out = backend.forward(q, k, v, self.layer, batch, self.scale, window=self.window, softcap=self.softcap,
                              sinks=self.sinks)
        return self.o_proj(out.reshape(T, -1))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q and k heads [T, H + Hkv, D], before rotation; v [T, Hkv, D]); families with other norms
        between the projection and the rotation override it."""
        T = x.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        qk = qkv[:, :(H + Hkv) * D].view(T, H + Hkv, D)
        v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
        if self.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])], dim=1)
        return qk, v


class MLP(nn.Module):
    def __init__(self, config, intermediate_size: int | None = None, bias: bool = False):
        super().__init__()
        self.inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=bias)
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=bias)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if cpu_elementwise.usable(gate_up):
            return self.down_proj(cpu_elementwise.silu_mul(gate_up))
        return self.down_proj(self.act(*gate_up.split(self.inter, dim=-1)))

    @staticmethod
    def act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The activation between the projections, of gate and up apart (a mixture's stacked experts
        run it between their kernel's two GEMMs: engine/models/moe.py)."""
        return nn.functional.silu(gate) * up


class DecoderLayer(nn.Module):
    """Pre-norm attention then MLP, each residual; other families pass their own attention and MLP."""

    def __init__(self, config, layer: int, attention: nn.Module | None = None, mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = Attention(config, layer) if attention is None else attention
        self.mlp = MLP(config) if mlp is None else mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tp = tp.building()         # built sharded: attention and MLP give partial sums (engine/distributed/)

    def forward(self, h, rope, batch, backend):
        h = h + tp.all_reduce(self.self_attn(self.input_layernorm(h), rope, batch, backend), self.tp)
        return h + tp.all_reduce(self.mlp(self.post_attention_layernorm(h)), self.tp)


def embedding(config) -> nn.Embedding:
    """The token embedding, left uninitialised on the meta device, where load_model builds a model whose
    every weight it loads: the random init there imports torch._dynamo, over a second of every start."""
    size = (config.vocab_size, config.hidden_size)
    return nn.Embedding(*size, _weight=torch.empty(size)) if torch.empty(0).is_meta else nn.Embedding(*size)


class LlamaModel(nn.Module):
    # Other families bring their own layers, final norm and rotary tables (built alike).
    layer_class, norm_class, rotary_class = DecoderLayer, RMSNorm, Rotary

    def __init__(self, config, max_positions: int):
        super().__init__()
        self.embed_tokens = embedding(config)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = self.rotary_class(config, head_dim, max_positions)


class LlamaForCausalLM(nn.Module):
    """Returns (final normed hidden states [T, H], captured hidden states {index: [T, H]})."""
    model_class = LlamaModel     # embed_tokens, layers, norm, rotary: other families bring their own

    def __init__(self, config, max_positions: int):
        super().__init__()
        self.config = config
        self.model = self.model_class(config, max_positions)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.packed_head: PrepackedLinear | None = None
        self.quant_head: nn.Module | None = None        # engine/models/quant.py, when the head is quantized
        self.tp = tp.building()         # built sharded: the embedding and lm_head hold a block of the vocabulary

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def attention(self) -> Attention:
        return self.model.layers[0].self_attn

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return tp.embed(self.model.embed_tokens, input_ids, self.tp)

    def fusable_decode(self) -> bool:
        """Whether decode steps may run a layer per C call (fused_decode.py): every layer is this file's
        attention (no q/k norm, and none of the variants kernels/cpu_decoder.c lacks: sliding window,
        logit soft-cap, sinks) and MLP, not sharded, with w4a8 weights and bf16 norms."""
        from engine.models.quant import MixedLinear, W4A8Linear

        for layer in self.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            if not (type(layer) is DecoderLayer and type(attention) is Attention and type(mlp) is MLP
                    and layer.tp is None and not attention.qk_norm):
                return False
            if any(getattr(attention, name, None) is not None for name in ("window", "softcap", "sinks")):
                return False
            linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(isinstance(m, (W4A8Linear, MixedLinear)) for m in linears):
                return False
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if not all(type(n) is RMSNorm and n.weight.dtype == torch.bfloat16 for n in norms):
                return False
        return True

    def lm_head_weight(self) -> torch.Tensor:
        """The head's float weights, for the rare reader of its rows (token maps, EAGLE drafts): a
        quantized head keeps no float copy, so they are rebuilt here."""
        if self.quant_head is not None:
            return self.quant_head.dequantized()
        if self.tie_word_embeddings:
            embedding = self.model.embed_tokens
            return embedding.dequantized() if hasattr(embedding, "dequantized") else embedding.weight
        return self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                backend: AttentionBackend, input_embeds: torch.Tensor | None = None):
        h = self.embed(input_ids) if input_embeds is None else input_embeds
        rope = self.model.rotary(positions, h.dtype)
        # Every layer's input is kept when some are asked for, and picked at the end: torch.compile
        # (2.13) drops tensors a loop adds to a container only on some iterations.
        states: list[torch.Tensor] | None = [] if batch.capture_hidden else None
        fused = fused_decode.plan(self, h, rope, batch, backend)
        for i, layer in enumerate(self.model.layers):
            if states is not None:
                states.append(h)
            h = layer(h, rope, batch, backend) if fused is None else fused_decode.run(fused, i, h)
        captured: dict[int, torch.Tensor] = {}
        if states is not None:
            states.append(h)
            captured = {i: states[i] for i in batch.capture_hidden}
        return self.model.norm(h), captured

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quant_head is not None:
            logits = self.quant_head(hidden).float()
        elif self.packed_head is not None:
            logits = self.packed_head(hidden).float()
        else:
            logits = torch.nn.functional.linear(hidden, self.lm_head_weight()).float()
        return tp.gather_vocab(logits, self.config.vocab_size, self.tp)

    def prepack(self) -> int:
        """Pack the decoder's and the head's weights for CPU matmuls (engine/models/prepack.py), once the
        weights are loaded and final; returns the bytes added."""
        added = prepack_linears(self.model)
        if self.quant_head is not None:
            return added
        # Not owned: the embedding shares a tied head, and drafts (EAGLE's, token maps) read its rows.
        self.packed_head = PrepackedLinear(self.lm_head_weight(), owned=False)
        return added + self.packed_head.extra_bytes

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     sinks: Optional[dict[str, Callable[[torch.Tensor], None]]] = None) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up; every parameter must be given.
        A (fused) name in `sinks` goes to its callable instead (a layer that quantizes it)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        pending: dict[str, dict[str, torch.Tensor]] = {}
        layers = self.config.num_hidden_layers
        sinks = dict(sinks or {})
        # No loop here keeps a tensor while the next is read (a vocabulary-sized one is ~1 GB in fp32):
        # each `del`s its own before asking for the next.
        weights = local_weights(filter(lambda item: not is_mtp_weight(item[0], layers), weights))
        for name, tensor in fuse_weights(weights, pending):
            if name == "lm_head.weight" and self.tie_word_embeddings:
                pass                            # the embedding is the head
            elif name in sinks:
                sinks.pop(name)(tensor)
            elif name in params:
                with torch.no_grad():
                    params[name].copy_(tensor.to(params[name].dtype))
                loaded.add(name)
            elif "rotary_emb" not in name:
                raise KeyError(f"unexpected weight {name!r}")
            del tensor
        missing = sorted(set(params) - loaded) + sorted(sinks)
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")


def is_mtp_weight(name: str, num_layers: int) -> bool:
    """Whether `name` belongs to a multi-token-prediction layer: MiMo's `model.mtp_layers.*` or a
    DeepSeek-style nextn layer stored after the decoder layers (`model.layers.{i}`, i >= num_layers).
    The target skips them; engine/models/mtp.py loads them as a draft."""
    if name.startswith("model.mtp_layers."):
        return True
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= num_layers


_FUSED = {  # part name -> (fused name, order of the parts)
    "q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "k_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "v_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
    "up_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
}


def fuse_weights(weights: Iterable[tuple[str, torch.Tensor]], pending: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Concatenate q/k/v (and gate/up) weights and biases as soon as all parts of one have arrived (an
    FP8 checkpoint's with their scales). Parts whose group never completes (DeepSeek's lone q_proj) come
    last, as they are."""
    for name, tensor in weights:
        parts = name.split(".")
        part = parts[-2] if len(parts) >= 2 else ""
        if part not in _FUSED:
            yield name, tensor
            del tensor
            continue
        fused, order = _FUSED[part]
        key = ".".join(parts[:-2] + [fused, parts[-1]])
        group = pending.setdefault(key, {})
        group[part] = (name, tensor)
        del tensor
        if len(group) == len(order):
            del pending[key]
            yield key, cat_rows([group.pop(p)[1] for p in order])
    for group in pending.values():
        yield from group.values()
    pending.clear()
