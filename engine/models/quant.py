"""Quantized linears for the CPU, through kernels that ship with torch.

- w8a8_int8 (the default for GGUF files on CPUs without AVX-512 VNNI where the MLP projections have 2M
  weights or more): int8 weights, one scale per output row, and int8 activations quantized per row on
  the fly (symmetric, one scale per token); the product runs in oneDNN's int8 GEMM (AMX or VNNI where
  the CPU has them). Integer products are exact, so a row's result never depends on the other rows of
  the call (what speculative decoding's losslessness leans on), and the cost barely grows with the rows
  (reading the weights dominates at a few rows; docs/benchmarking.md). 1 byte per weight.
- w4a8 (the default for GGUF files on CPUs with AVX-512 VNNI): a GGUF's own 4-bit groups (below)
  times int8 activations quantized in the same groups of 32, in our C kernel (kernels/cpu_w4a8.c:
  VNNI integer dot products, weights unpacked once for up to 8 rows, each row's result independent of
  the others). Q4_0/Q4_1 scale and min kept as fp16 (0.625 bytes per weight); Q4_K's own 6-bit
  scales and mins and fp16 d and dmin per 256, as the file stores them (0.58). A target's 5-bit, Q6_K
  and Q8_0 layers and head are served as the file stores them too (the same kernel: Q5Linear, Q5_K at
  0.69 bytes a weight and Q5_0, Q5_1 and GPT-OSS's MXFP4 at 0.75; Q6KLinear, 0.82; Int8GroupLinear,
  1.125); a fused projection whose parts come in different formats chains them
  (MixedLinear). Layers in other types (Q2_K, Q3_K, IQ*) and a float head become symmetric int8
  groups of 32 there; an embedding the GGUF stores in one of these types stays in it (GroupEmbedding),
  another one becomes int8 rows. A float checkpoint's linears are rounded to 4-bit groups. It reads
  about half of w8a8_int8's bytes, so it is the faster of the two at the few rows of a decode or verify
  step; a long prefill, which is compute-bound, runs faster in oneDNN's GEMM where the CPU has AMX.
- int4: groups of 32 weights along the input, w = q * scale + min with q in 0..15 (GGUF's Q4_0, Q4_1
  and Q4_K are exactly this, engine/loader/gguf_quant.py), weight-only: torch's
  _weight_int4pack_mm_for_cpu with bf16 activations (its fp32 path is scalar, many times slower), the
  scale and min rounded to bf16 there. About as fast as w8a8_int8 for one row, several times its cost for
  8. 0.625 bytes per weight, and a GGUF's own 4-bit weights
  served exactly.
The layers quantized are the decoder's (q/k/v, o, gate/up, down); with w8a8_int8 and w4a8 the lm_head
too, and the embedding is kept as int8 rows (Int8Embedding; under w4a8 a GGUF's own groups where it
has them). Norms stay dense.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from engine.loader.gguf_quant import GROUP, Groups, dequantize, unpack
from spec_kernels import cpu_w4a8

aten = torch.ops.aten
QUANTIZED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# A draft's input projection (EAGLE's fc over [embedding; feature(s)], MTP's eh_proj): as large as a
# decoder projection and run on every draft forward.
DRAFT_LINEARS = ("fc", "proj")
# Fused projections and the checkpoint parts they are made of, in order.
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class Int4Linear(nn.Module):
    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
                 bias: Optional[nn.Parameter]):
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 2
        self.register_buffer("weight_int4", aten._convert_weight_to_int4pack_for_cpu(unpack(packed).int(), 1),
                             persistent=False)
        # The kernel computes (q - 8) * scale + zero per group: zero = min + 8 * scale.
        self.register_buffer("scale_zero", torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous()
                             .to(torch.bfloat16), persistent=False)
        self.bias = bias

    @classmethod
    def from_groups(cls, groups: Groups, bias: Optional[nn.Parameter]) -> "Int4Linear":
        return cls(groups.q, *groups.scale_min(), bias)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: Optional[nn.Parameter]) -> "Int4Linear":
        """Round float weights to groups of 32 (round_to_groups)."""
        from engine.loader.gguf_quant import pack

        q, scale, low = round_to_groups(weight)
        return cls(pack(q.numpy()), scale, low, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features).to(torch.bfloat16), self.weight_int4,
                                             GROUP, self.scale_zero).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class W4A8Linear(nn.Module):
    """4-bit weight groups x int8 activations (kernels/cpu_w4a8.c)."""
    bits = 4
    SLICE = 4096        # rows converted at a time: a vocabulary's temporaries would be several times its size

    def __init__(self, groups: Callable[[int, int], tuple], out_features: int, in_features: int,
                 bias: Optional[nn.Parameter], k_scales: bool = False):
        """groups(r0, r1) -> (q, scale, min, per-256 scales or None) of rows r0:r1 (q below 2**bits, 4 bits
        one or two a byte, scale and min per group of 32; with k_scales Q4_K's or Q5_K's own, for 6 bits
        Q6_K's: cpu_w4a8.pack), packed into the kernel's layout slice by slice."""
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        weight, scale, low = cpu_w4a8.empty(out_features, in_features, self.bits, k_scales)
        for r0 in range(0, out_features, self.SLICE):
            b0, b1 = r0 // 16, -(-min(r0 + self.SLICE, out_features) // 16)
            q, part_scale, part_low, sup = groups(r0, r0 + self.SLICE)
            weight[b0:b1], scale[b0:b1], low[b0:b1] = cpu_w4a8.pack(q, part_scale, part_low, self.bits, sup,
                                                                    nibbles=q.shape[1] * 2 == in_features)
        self.register_buffer("weight_packed", weight, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("low", low, persistent=False)
        self.bias = bias
        self._layer: Optional[cpu_w4a8.Layer] = None

    @classmethod
    def from_groups(cls, groups: Groups, bias: Optional[nn.Parameter]) -> "W4A8Linear":
        """A GGUF's groups of this class's width (gguf_quant.Groups) as they are: Q4_K's and Q5_K's with
        their own scales (per-256 d and dmin)."""
        def rows(r0: int, r1: int) -> tuple:
            part = groups.map(lambda t: t[r0:r1])
            return part.q, part.scale, part.low, part.super

        k_scales = groups.super is not None and groups.super.shape[-1] == 2
        return cls(rows, groups.q.shape[0], groups.columns, bias, k_scales)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: Optional[nn.Parameter]) -> "W4A8Linear":
        return cls(lambda r0, r1: (*round_to_groups(weight[r0:r1]), None), *weight.shape, bias)

    @classmethod
    def rounded(cls, groups: Groups, bias: Optional[nn.Parameter]) -> "W4A8Linear":
        """A GGUF's wider groups (Q6_K, 8 bits) rounded to 4-bit groups slice by slice, as `quantize`
        rounds their float copy (a draft's, DRAFT_HEADS), without reading that copy."""
        return cls(lambda r0, r1: (*round_to_groups(dequantize(groups.map(lambda t: t[r0:r1]))), None),
                   groups.q.shape[0], groups.columns, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():       # the opaque op: no struct kept across traces
            return cpu_w4a8.linear(x, self.weight_packed, self.scale, self.low, self.bias, self.out_features)
        return cpu_w4a8.call(self.c_layer(), x)

    def c_layer(self) -> cpu_w4a8.Layer:
        """The C struct, made on the first eager call (the bias loads after this layer is built) and
        again if a tensor has moved."""
        if self._layer is None or self._layer.weight != self.weight_packed.data_ptr() or (
                self.bias is not None and self._layer.bias != self.bias.data_ptr()):
            self._layer = cpu_w4a8.layer(self.weight_packed, self.scale, self.low, self.bias, self.out_features)
        return self._layer

    def dequantized(self) -> torch.Tensor:
        """The float weights [N, K] the layer computes with (for code that reads a head's rows)."""
        return cpu_w4a8.unpack(self.weight_packed, self.scale, self.low, self.out_features)


class Int8GroupLinear(W4A8Linear):
    """8-bit groups of 32 x int8 activations in the same kernel: under w4a8, a GGUF's Q8_0 layers as stored, and float weights (a head, a layer the file keeps in another type) rounded to
    symmetric int8 groups (Q8_0's form)."""
    bits = 8

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: Optional[nn.Parameter]) -> "Int8GroupLinear":
        return cls(lambda r0, r1: (*int8_groups(weight[r0:r1]), None), *weight.shape, bias)


class _BlocksLinear(W4A8Linear):
    """A layer in a form only a GGUF's blocks make (`from_groups`): there is no rounding float weights
    into it."""

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: Optional[nn.Parameter]) -> "_BlocksLinear":
        raise TypeError(f"{cls.__name__} holds a GGUF's own blocks; float weights are quantized by W4A8Linear "
                        "or Int8GroupLinear")


class Q6KLinear(_BlocksLinear):
    """GGUF's Q6_K weights as they are (6-bit q, an int8 scale per 16, fp16 d per 256: 0.82 bytes a weight)
    x int8 activations in the same kernel: under w4a8, a GGUF's Q6_K layers and head, kept as the file's
    weights and smaller than int8 groups of them (1.125 bytes a weight)."""
    bits = 6


class Q5Linear(_BlocksLinear):
    """A GGUF's 5-bit groups as they are x int8 activations in the same kernel, under w4a8: Q5_K's with
    Q4_K's scales (0.69 bytes a weight; Q5_K_M files), and Q5_0's, Q5_1's and MXFP4's (GPT-OSS's
    experts) with an fp16 scale and min per 32 (0.75 bytes a weight; exact while a group's scale is
    within fp16's range, as real weights' are: gguf_quant.py)."""
    bits = 5


class MixedLinear(nn.Module):
    """A fused projection whose parts a GGUF stores in different formats (Qwen2.5-Coder's Q4_K_M: q and k
    in Q4_K, v in Q6_K in half the layers), each part in its own layout (W4A8Linear, Q6KLinear): one
    kernel call over their chained structs quantizes the activations once and writes each part's
    columns. The file's weights exactly, where one format for all would round them again."""

    def __init__(self, parts: list[W4A8Linear], bias: Optional[nn.Parameter]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features, self.out_features = parts[0].in_features, sum(p.out_features for p in parts)
        self.bias = bias
        self._chain: Optional[list[cpu_w4a8.Layer]] = None     # the parts' structs, linked in order

    def _bias_slices(self) -> list[Optional[torch.Tensor]]:
        ends = torch.tensor([p.out_features for p in self.parts]).cumsum(0).tolist()
        return [None if self.bias is None else self.bias[end - p.out_features:end] for p, end in zip(self.parts, ends)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():       # the parts' opaque ops, each adding its bias as the chain does
            return torch.cat([cpu_w4a8.linear(x, p.weight_packed, p.scale, p.low, b, p.out_features)
                              for p, b in zip(self.parts, self._bias_slices())], -1)
        return cpu_w4a8.call(self.c_layer(), x, self.out_features)

    def c_layer(self) -> cpu_w4a8.Layer:
        """The chain's first struct, made on the first eager call and again if a tensor has moved."""
        first = self.parts[0]
        if self._chain is None or self._chain[0].weight != first.weight_packed.data_ptr() or (
                self.bias is not None and self._chain[0].bias != self.bias.data_ptr()):
            self._chain = [cpu_w4a8.layer(p.weight_packed, p.scale, p.low, b, p.out_features)
                           for p, b in zip(self.parts, self._bias_slices())]
            cpu_w4a8.chain(self._chain)
        return self._chain[0]

    def dequantized(self) -> torch.Tensor:
        return torch.cat([p.dequantized() for p in self.parts])


# The layers that run in the w4a8 kernel, a struct each (`c_layer`): what cpu_w4a8.grouped takes.
W4A8_LAYERS = (W4A8Linear, MixedLinear)


def int8_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float weights [N, K] -> (q + 128 [N, K] uint8, scale, min = -128 * scale): symmetric groups of 32,
    the scale rounded to fp16 (what the kernel keeps) before the weights are divided by it."""
    w = weight.detach().float().view(weight.shape[0], -1, GROUP)
    scale = (w.abs().amax(-1) / 127).half().float()
    steps = torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    q = ((w / steps).round_().clamp_(-127, 127) + 128).view(weight.shape).to(torch.uint8)
    return q, scale, -128 * scale


def round_to_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float weights [N, K] -> (q [N, K] in 0..15, scale, min [N, K / 32]): each group's min and max map
    to 0 and 15."""
    w = weight.detach().float().view(weight.shape[0], -1, GROUP)
    low, high = w.amin(-1), w.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = ((w - low[..., None]) / scale[..., None]).round().clamp(0, 15).view(weight.shape)
    return q.to(torch.uint8), scale, low


def quantize_rows(weight: torch.Tensor, slice_rows: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per row: (q [N, K] int8, scale [N] fp32). In slices of rows: a
    whole vocabulary's fp32 temporaries would be several times its size (Qwen2.5's 151936 x 1536
    embedding: ~1 GB each)."""
    scale = torch.empty(weight.shape[0])
    q = torch.empty(weight.shape, dtype=torch.int8)
    for rows in range(0, weight.shape[0], slice_rows):
        w = weight.detach()[rows:rows + slice_rows].float()
        s = scale[rows:rows + slice_rows] = (w.abs().amax(-1) / 127).clamp(min=1e-12)
        q[rows:rows + slice_rows] = (w / s[:, None]).round_().clamp_(-127, 127)
    return q, scale


class Int8Embedding(nn.Module):
    """A token embedding kept as int8 rows (quantize_rows): a lookup reads 1 byte per value, and a tied
    head is made from the same rows (Qwen2.5-1.5B: 0.93 GB of fp32 embedding becomes 0.23 GB)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = q.shape
        self.register_buffer("weight_int8", q, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.weight_int8[ids].float() * self.scale[ids, None]).to(self.dtype)

    def dequantized(self) -> torch.Tensor:
        return (self.weight_int8.float() * self.scale[:, None]).to(self.dtype)


class GroupEmbedding(nn.Module):
    """A token embedding kept as a GGUF's own groups (gguf_quant.Groups, rows as the file stores them):
    a lookup dequantizes its rows alone, the file's values exactly. Qwen2.5-1.5B's Q4_K embedding holds
    0.14 GB, against 0.23 GB as int8 rows, and loading never reads its 0.93 GB fp32 copy."""

    def __init__(self, groups: Groups, dtype: torch.dtype):
        super().__init__()
        self.bits, self.dtype = groups.bits, dtype
        self.num_embeddings, self.embedding_dim = groups.q.shape[0], groups.columns
        for name, t in zip(Groups._fields[1:], groups[1:]):
            self.register_buffer(name, t, persistent=False)

    def groups(self) -> Groups:
        return Groups(self.bits, self.q, self.scale, self.low, self.super)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.groups().map(lambda t: t[ids.reshape(-1)])
        return dequantize(rows).to(self.dtype).view(*ids.shape, self.embedding_dim)

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.groups()).to(self.dtype)


class W8A8Linear(nn.Module):
    _ZERO_POINT = 128           # int8 activations, offset into uint8 for oneDNN's u8 x s8 product

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: Optional[nn.Parameter]):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight_int8", torch.ops.onednn.qlinear_prepack(q, None), persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("zero_points", torch.zeros(self.out_features, dtype=torch.int64), persistent=False)
        self.bias = bias

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: Optional[nn.Parameter]) -> "W8A8Linear":
        return cls(*quantize_rows(weight), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        step = rows.abs().amax(-1, keepdim=True) / 127
        a = (torch.round(rows / step.clamp(min=1e-30)) + 128).to(torch.uint8)
        y = torch.ops.onednn.qlinear_pointwise(a, 1.0, self._ZERO_POINT, self.weight_int8, self.scale,
                                               self.zero_points, None, 1.0, 0, torch.float32, "none", [], "")
        y = y * step
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float weights [N, K] the layer computes with (for code that reads a head's rows)."""
        eye = torch.eye(self.in_features)
        rows = torch.ops.onednn.qlinear_pointwise(
            (eye * 127 + 128).to(torch.uint8), 1.0, self._ZERO_POINT, self.weight_int8, self.scale,
            self.zero_points, None, 1.0, 0, torch.float32, "none", [], "")
        return (rows / 127).t().contiguous()


# --quantization's formats, and int8_groups: under w4a8, float linears kept in 8 bits.
KINDS = {"int4": Int4Linear, "w8a8_int8": W8A8Linear, "w4a8": W4A8Linear, "int8_groups": Int8GroupLinear}
# What the linears a GGUF stores in 4-bit groups become, per kind; a target's 5-bit (Q5_K, Q5_0, Q5_1,
# MXFP4), Q6_K and Q8_0 ones; and its other linears (Q3_K, ...): with w4a8 they keep 8 bits rather than
# being rounded to 4.
FROM_GROUPS = {"int4": Int4Linear, "w4a8": W4A8Linear}
WIDER_GROUPS = {"w4a8": {5: Q5Linear, 6: Q6KLinear, 8: Int8GroupLinear}}
BESIDE_GROUPS = {"int4": "int4", "w4a8": "int8_groups"}
# The head under each kind (int4 keeps a float one); the embedding is int8 rows beside a quantized head.
HEADS = {"w8a8_int8": W8A8Linear, "w4a8": Int8GroupLinear, "int8_groups": Int8GroupLinear}
# A draft's bits change only how often its tokens are accepted, and reading its bytes is its cost: under
# w4a8 a draft's head is 4-bit too, as are a GGUF draft's layers stored above 4 bits (same accept
# length on Qwen2.5-Coder; docs/serving.md, --speculative-draft-model-quantization).
DRAFT_HEADS = {**HEADS, "w4a8": W4A8Linear}


def decoder_linears(model: nn.Module, attrs: Sequence[str] = QUANTIZED_LINEARS
                    ) -> Iterable[tuple[str, nn.Module, str]]:
    """(checkpoint prefix, parent module, attribute) of every quantizable linear of the decoder."""
    for name, module in model.named_modules():
        for attr in attrs:
            if isinstance(getattr(module, attr, None), nn.Linear):
                yield f"{name}.{attr}" if name else attr, module, attr


def quantizable(linear: nn.Linear, kind: str) -> bool:
    return kind == "w8a8_int8" or linear.in_features % GROUP == 0    # 4-bit kinds need whole groups of 32


def quantize_loaded(model: nn.Module, kind: str) -> None:
    """Replace a draft model's loaded float linears (decoder and input projection) with `kind` ones, and
    its own lm_head's matmul with a draft's head under `kind` (none under int4)."""
    for _, parent, attr in list(decoder_linears(model, QUANTIZED_LINEARS + DRAFT_LINEARS)):
        linear = getattr(parent, attr)
        if quantizable(linear, kind):
            setattr(parent, attr, KINDS[kind].quantize(linear.weight, linear.bias))
    head = getattr(model, "head", None)         # an EAGLE-3 head's own rows, or an FR-Spec map's
    if hasattr(head, "quantize"):
        quantize_draft_head(head, kind)


def quantize_draft_head(head, kind: Optional[str]) -> None:
    """A draft's own head rows (speculative/token_map.py HotVocabHead) under `kind`, as DRAFT_HEADS says."""
    if kind in DRAFT_HEADS and (kind == "w8a8_int8" or head.weight.shape[1] % GROUP == 0):
        head.quantize(DRAFT_HEADS[kind])


def quantize_while_loading(model: nn.Module, kind: str, draft: bool = False
                           ) -> dict[str, Callable[[torch.Tensor], None]]:
    """Free the decoder's float linears now and return, per (fused) checkpoint weight name, where its
    tensor goes when loading reads it: quantized as it arrives, so the float model never exists whole.
    A `draft` model's head is quantized as DRAFT_HEADS says."""
    sinks: dict[str, Callable[[torch.Tensor], None]] = {}
    for prefix, parent, attr in list(decoder_linears(model)):
        linear = getattr(parent, attr)
        if not quantizable(linear, kind):
            continue
        pending = _Pending(linear.bias)
        setattr(parent, attr, pending)

        def sink(weight: torch.Tensor, parent=parent, attr=attr, bias=pending.bias) -> None:
            setattr(parent, attr, KINDS[kind].quantize(weight, bias))
            release_freed_memory()

        sinks[f"{prefix}.weight"] = sink
    if kind in HEADS and hasattr(model, "quant_head"):
        sinks.update(_vocab_sinks(model, (DRAFT_HEADS if draft else HEADS)[kind]))
    return sinks


def _vocab_sinks(model: nn.Module, head: type) -> dict[str, Callable[[torch.Tensor], None]]:
    """The embedding kept as int8 rows, and a `head` layer: a tied one made from the same weights (with
    W8A8Linear the same rows), an untied one from its own; neither keeps a float copy. What a GGUF's
    own groups made (install_gguf_groups) stays."""
    sinks = {}
    if not isinstance(model.model.embed_tokens, GroupEmbedding):
        dtype = model.model.embed_tokens.weight.dtype
        model.model.embed_tokens = _Pending(None)

        def embedding(weight: torch.Tensor) -> None:
            q, scale = quantize_rows(weight)
            model.model.embed_tokens = Int8Embedding(q, scale, dtype)
            if model.tie_word_embeddings:
                model.quant_head = W8A8Linear(q, scale, None) if head is W8A8Linear else head.quantize(weight, None)
            release_freed_memory()

        sinks["model.embed_tokens.weight"] = embedding
    if not model.tie_word_embeddings:
        del model.lm_head
        if model.quant_head is None:        # else made from a GGUF's own groups
            def untied_head(weight: torch.Tensor) -> None:
                model.quant_head = head.quantize(weight, None)
                release_freed_memory()

            sinks["lm_head.weight"] = untied_head
    return sinks


class _Pending(nn.Module):
    """A linear whose weight has not arrived yet; it keeps the bias, which loads as usual."""

    def __init__(self, bias: Optional[nn.Parameter]):
        super().__init__()
        self.bias = bias

    def forward(self, x):
        raise RuntimeError("a quantized linear was used before its weight was loaded")


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS. Loading frees many tensor-sized buffers, which glibc
    keeps (its mmap threshold grows with each freed large block): trimmed after each quantized layer,
    Qwen2.5-1.5B's peak resident memory drops from 2.87 to 2.50 GiB. Elsewhere than glibc, nothing to do."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def install_gguf_groups(model: nn.Module, groups: Callable[[str], Optional[Groups]], kind: str,
                        draft: bool = False) -> set[str]:
    """Replace every decoder linear whose checkpoint parts all come as GGUF groups (`groups(hf name)` ->
    gguf_quant.Groups or None), or which comes so whole (Phi-3's files store q/k/v and gate/up fused), with
    a `kind` layer built from them: 4-bit groups as FROM_GROUPS says, and under w4a8 a target's wider ones
    as WIDER_GROUPS says (a `draft`'s rounded to 4 bits, DRAFT_HEADS says why) and a fused projection's
    parts of different formats chained (MixedLinear); likewise an untied head, and the embedding (GroupEmbedding, a tied head made from the
    same groups). Returns the checkpoint names now provided (their float copies need not be loaded)."""
    def builder(bits: int) -> Optional[Callable[[Groups, Optional[nn.Parameter]], nn.Module]]:
        if bits == 4:
            return FROM_GROUPS[kind].from_groups
        if draft:
            return W4A8Linear.rounded if kind == "w4a8" else None
        wider = WIDER_GROUPS.get(kind, {}).get(bits)
        return wider.from_groups if wider else None

    provided: set[str] = set()
    for prefix, parent, attr in list(decoder_linears(model)):
        base, fused = prefix.rsplit(".", 1)[0], groups(f"{prefix}.weight")     # fused in the file: Phi-3's
        names = [f"{prefix}.weight"] if fused is not None else \
            [f"{base}.{p}.weight" for p in PARTS.get(attr, (attr,))]
        parts = [fused] if fused is not None else [groups(n) for n in names]
        if any(p is None or builder(p.bits) is None for p in parts):
            continue        # a part in another type (Q3_K, ...): quantized from floats (BESIDE_GROUPS)
        bias, formats = getattr(parent, attr).bias, {(p.bits, p.super is None) for p in parts}
        if len(formats) > 1 and kind == "w4a8":
            layer = MixedLinear([builder(p.bits)(p, None) for p in parts], bias)
        else:
            if len(formats) > 1:        # int4: 4-bit parts with and without Q4_K's own scales, as fp32 ones
                parts = [Groups(4, p.q, *p.scale_min()) for p in parts]
            fused = Groups(parts[0].bits, *(None if parts[0][i] is None else torch.cat([p[i] for p in parts])
                                            for i in range(1, 5)))
            layer = builder(fused.bits)(fused, bias)
        setattr(parent, attr, layer)
        provided.update(names)
        release_freed_memory()
    vocab = kind in HEADS and hasattr(model, "quant_head")
    head = groups("lm_head.weight") if vocab and not model.tie_word_embeddings else None
    if head is not None and builder(head.bits) is not None:
        model.quant_head = builder(head.bits)(head, None)
        provided.add("lm_head.weight")
    embedding = groups("model.embed_tokens.weight") if vocab else None
    # A tied head is made from the same groups; where they cannot make one, both come from the floats.
    if embedding is not None and not (model.tie_word_embeddings and builder(embedding.bits) is None):
        model.model.embed_tokens = GroupEmbedding(embedding, model.model.embed_tokens.weight.dtype)
        if model.tie_word_embeddings:
            model.quant_head = builder(embedding.bits)(embedding, None)
        provided.add("model.embed_tokens.weight")
    return provided
