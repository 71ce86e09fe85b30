"""4-, 5-, 6- or 8-bit weight groups x 8-bit activations on the CPU: kernels/cpu_w4a8.c, built once per machine
(kernels/native.py) and called through ctypes in eager mode, as the opaque op spec::w4a8_linear
inside a compiled model. `kernel_name()` says which instructions it runs on this CPU."""

from __future__ import annotations

import ctypes
import itertools
from typing import Optional

import torch

from spec_kernels.native import Kernel

GROUP = 32


class Layer(ctypes.Structure):
    """struct spec_w4a8_layer: what a call needs besides its activations, set up once per layer (`layer`),
    and the layers of the next output columns (`chain`)."""
    _fields_ = [("K", ctypes.c_int64), ("N", ctypes.c_int64), ("bits", ctypes.c_int64), ("bias_bf16", ctypes.c_int64),
                ("k_scales", ctypes.c_int64), ("weight", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("low", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("next", ctypes.c_void_p)]


def _declare(library: ctypes.CDLL) -> None:
    fn = library.spec_w4a8_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    grouped = library.spec_w4a8_grouped
    grouped.restype = ctypes.c_int
    grouped.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                        ctypes.c_int64, ctypes.c_int]
    library.spec_w4a8_kernel.restype = ctypes.c_char_p
    library.spec_w4a8_pack.restype = None
    library.spec_w4a8_pack.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                       ctypes.c_void_p, ctypes.c_int]


_kernel = Kernel("cpu_w4a8.c", _declare,
                 "the w4a8 CPU kernel is unavailable (%s): --quantization auto serves GGUF files as int4 or "
                 "w8a8_int8 instead (slower decoding); install a C compiler (gcc) or set CC",
                 detail=lambda lib: lib.spec_w4a8_kernel().decode())
library, failure = _kernel.library, _kernel.failure


def kernel_name() -> Optional[str]:
    return _kernel.detail()


def empty(out_features: int, in_features: int, bits: int, k_scales: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised weight, scale and min tensors of a packed layer (the shapes `pack` fills)."""
    blocks, G = -(-out_features // 16), in_features // GROUP
    weight, half = torch.empty(blocks, G, bits, 64, dtype=torch.uint8), torch.float16
    if bits == 6:
        return weight, torch.empty(blocks, G, 32, dtype=torch.int8), torch.empty(blocks, G // 8, 16, dtype=half)
    if k_scales:
        return weight, torch.empty(blocks, G, 32, dtype=torch.uint8), torch.empty(blocks, G // 8, 32, dtype=half)
    return weight, torch.empty(blocks, G, 16, dtype=half), torch.empty(blocks, G, 16, dtype=half)


def pack(q: torch.Tensor, scale: torch.Tensor, low: Optional[torch.Tensor], bits: int = 4,
         sup: Optional[torch.Tensor] = None, nibbles: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, K] (values below 2**bits, K a multiple of 32; with `nibbles`, 4 bits two a byte as GGUF
    stores them, [N, K / 2]: gguf_quant.pack) and scale/min [N, K / 32] -> the kernel's
    layout (kernels/cpu_w4a8.c): uint8 [blocks, G, bits, 64] (4, 5, 6 or 8 vectors), rows padded to
    blocks of 16 with zeros, and scales and mins: from floats, fp16 [blocks, G, 16] each; from Q4_K's or
    Q5_K's uint8 sc and m with `sup` its (d, dmin) [N, K / 256, 2], uint8 [blocks, G, 32] and fp16
    [blocks, K / 256, 32];
    6 bits, from Q6_K's int8 scales [N, K / 16] and `sup` d [N, K / 256, 1] (low None), int8
    [blocks, G, 32] and fp16 [blocks, K / 256, 16]."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"w4a8 CPU kernel unavailable: {failure()}")
    q = q.to(torch.uint8).contiguous()
    N, K = q.shape[0], q.shape[1] * (2 if nibbles else 1)
    G, pad = K // GROUP, -N % 16
    packed = torch.empty(-(-N // 16), G, bits, 64, dtype=torch.uint8)
    lib.spec_w4a8_pack(q.data_ptr(), nibbles, N, K, bits, packed.data_ptr(), torch.get_num_threads())

    def per_block(t: torch.Tensor) -> torch.Tensor:
        """[N, C, F] -> [blocks, C, F * 16]: per column, F vectors of a block's 16 rows."""
        t = torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad))
        B, C, F = t.shape[0] // 16, t.shape[1], t.shape[2]
        return t.view(B, 16, C, F).permute(0, 2, 3, 1).reshape(B, C, F * 16).contiguous()

    if bits == 6:
        return packed, per_block(scale.to(torch.int8).view(N, G, 2)), per_block(sup.half())
    if sup is not None:
        return packed, per_block(torch.stack([scale, low], -1).to(torch.uint8)), per_block(sup.half())
    return packed, per_block(scale.float().half()[..., None]), per_block(low.float().half()[..., None])


def unpack(weight: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, out_features: int) -> torch.Tensor:
    """The float weights [N, K] the packed layout holds (q * scale + min; Q4_K's and Q5_K's scale = d * sc
    and min = -(dmin * m); 6 bits' d * scale * (q - 32)), as the kernel computes them."""
    B, G, bits = weight.shape[:3]
    v = weight.view(B, G, -1, 16, 4)
    if bits != 8:                                                       # split the nibbles
        v = torch.cat([v[:, :, :4] & 0x0F, v[:, :, :4] >> 4], 2)
    high = weight.view(B, G, -1, 16, 4)[:, :, 4:]
    if bits == 5:
        v = v | torch.cat([((high >> j) & 1) << 4 for j in range(8)], 2)
    if bits == 6:
        v = v | torch.cat([((high[:, :, c:c + 1] >> (2 * t)) & 3) << 4 for c in range(2) for t in range(4)], 2)
    q = v.permute(0, 3, 1, 2, 4).reshape(B * 16, G, GROUP).float()

    def per_row(t: torch.Tensor, F: int) -> torch.Tensor:      # per_block's inverse: [B * 16, C, F]
        return t.view(B, t.shape[1], F, 16).permute(0, 3, 1, 2).reshape(B * 16, t.shape[1], F).float()

    if bits == 6:
        step = per_row(scale, 2) * per_row(low, 1).repeat_interleave(8, 1)
        return ((q - 32).view(B * 16, G, 2, 16) * step[..., None]).view(B * 16, -1)[:out_features]
    if scale.dtype == torch.uint8:                                      # Q4_K's and Q5_K's
        sm, d = per_row(scale, 2), per_row(low, 2).repeat_interleave(8, 1)
        step, bottom = d[..., :1] * sm[..., :1], -(d[..., 1:] * sm[..., 1:])
    else:
        step, bottom = per_row(scale, 1), per_row(low, 1)
    return (q * step + bottom).view(B * 16, -1)[:out_features]


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
           bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """x [..., K] (fp32 or bf16) times packed weights (`pack`, 4, 5, 6 or 8 bits) of `out_features` rows, plus
    bias (fp32, bf16 or None; added in fp32 before the result is rounded to x's dtype): [..., N]."""
    if torch.compiler.is_compiling():
        return torch.ops.spec.w4a8_linear(x, weight, scale, low, bias, out_features)
    return call(layer(weight, scale, low, bias, out_features), x)


def layer(weight: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bias: Optional[torch.Tensor],
          out_features: int) -> Layer:
    """The C struct of a packed layer: it points into the tensors, which must outlive it unchanged."""
    if bias is not None:
        assert bias.dtype in (torch.float32, torch.bfloat16) and bias.is_contiguous()
    return Layer(weight.shape[1] * GROUP, out_features, weight.shape[2],
                 bias is not None and bias.dtype == torch.bfloat16, scale.dtype == torch.uint8,
                 weight.data_ptr(), scale.data_ptr(), low.data_ptr(),
                 bias.data_ptr() if bias is not None else None)


def chain(layers: list[Layer]) -> Layer:
    """The first of `layers`, each linked to the next: one call computes their rows one after another,
    the activations quantized once. The structs must outlive the chain."""
    for first, second in zip(layers, layers[1:]):
        first.next = ctypes.addressof(second)
    return layers[0]


def call(layer: Layer, x: torch.Tensor, out_features: Optional[int] = None) -> torch.Tensor:
    """Eager calls: the kernel on x with a layer's struct (of a chain's `out_features` rows), and as
    little Python around it as can be (a layer runs ~100 times a token)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"w4a8 CPU kernel unavailable: {failure()}")
    N = out_features or layer.N
    rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, layer.K).contiguous()
    out = torch.empty((rows.shape[0], N), dtype=x.dtype)
    if rows.shape[0] == 0:
        return out.view(*x.shape[:-1], N)
    rc = lib.spec_w4a8_linear(ctypes.byref(layer), rows.data_ptr(), x.dtype == torch.bfloat16, rows.shape[0],
                              out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError("w4a8_linear: out of memory" if rc == -1 else "w4a8_linear: K is not a multiple "
                           "of 32 (of 256 for the K types), or differs within a chain")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], N)


def grouped(layers: list[Layer], counts: list[int], x: torch.Tensor, out_features: int) -> torch.Tensor:
    """Eager calls: x [sum(counts), K] (fp32 or bf16), its first counts[0] rows times layers[0], the next
    counts[1] times layers[1], ... (layers or chains of one K and `out_features` rows: a mixture's chosen
    experts) -> [sum(counts), out_features], each row as `call` with its layer alone gives it, in one call."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"w4a8 CPU kernel unavailable: {failure()}")
    if x.dim() != 2 or x.shape[0] != sum(counts) or x.shape[1] != layers[0].K:
        raise ValueError(f"w4a8_grouped: x {tuple(x.shape)} is not [{sum(counts)}, {layers[0].K}]")
    x = x.contiguous()
    out = torch.empty((x.shape[0], out_features), dtype=x.dtype)
    starts = (ctypes.c_int64 * (len(counts) + 1))(0, *itertools.accumulate(counts))
    pointers = (ctypes.c_void_p * len(layers))(*map(ctypes.addressof, layers))
    rc = lib.spec_w4a8_grouped(pointers, starts, len(layers), x.data_ptr(), x.dtype == torch.bfloat16,
                               out.data_ptr(), out_features, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError("w4a8_grouped: out of memory" if rc == -1 else
                           f"w4a8_grouped: a layer's K or rows differ from the others' or from {out_features}, or K "
                           "is not a multiple of 32 (256 for the K types)")
    return out


@torch.library.custom_op("spec::w4a8_linear", mutates_args=())
def _op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
        bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    return call(layer(weight, scale, low, bias, out_features), x)


@_op.register_fake
def _(x, weight, scale, low, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [M, K] -> (int8 values [M, K], group scales [M, K / 32]) as the kernel rounds them (tests)."""
    g = x.float().reshape(x.shape[0], -1, GROUP)
    amax = g.abs().amax(-1)
    # torch.full(...) / amax, not 127.0 / amax: torch computes the latter as 127 * (1 / amax), which
    # rounds differently from the kernel's division.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(g * inv[..., None])
    return q.reshape(x.shape).to(torch.int8), amax / 127.0


def reference(x: torch.Tensor, weights: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The product with float weights [N, K] (those a packed layer holds) in float64 (tests): the
    activations rounded to int8 groups as the kernel does, everything after that exact."""
    x8, dx = quantize_activations(x.reshape(-1, weights.shape[1]))
    xs = (x8.double().view(x8.shape[0], -1, GROUP) * dx.double()[..., None]).view(x8.shape)
    y = xs @ weights.double().t()
    if bias is not None:
        y = y + bias.double()
    return y.view(*x.shape[:-1], weights.shape[0])
