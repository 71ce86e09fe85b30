"""4-, 6- or 8-bit weight groups x 8-bit activations on the CPU: kernels/cpu_w4a8.c, built once per machine
(kernels/native.py) and called through ctypes in eager mode, as the opaque op spec::w4a8_linear
inside a compiled model. `kernel_name()` says which instructions it runs on this CPU."""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from spec_kernels.native import Kernel

GROUP = 32


class Layer(ctypes.Structure):
    """struct spec_w4a8_layer: what a call needs besides its activations, set up once per layer (`layer`)."""
    _fields_ = [("K", ctypes.c_int64), ("N", ctypes.c_int64), ("bits", ctypes.c_int64), ("bias_bf16", ctypes.c_int64),
                ("weight", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("low", ctypes.c_void_p),
                ("bias", ctypes.c_void_p)]


def _declare(library: ctypes.CDLL) -> None:
    fn = library.spec_w4a8_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    library.spec_w4a8_kernel.restype = ctypes.c_char_p


_kernel = Kernel("cpu_w4a8.c", _declare,
                 "the w4a8 CPU kernel is unavailable (%s): --quantization auto serves GGUF files as int4 or "
                 "w8a8_int8 instead (slower decoding); install a C compiler (gcc) or set CC")
library, failure = _kernel.library, _kernel.failure


def kernel_name() -> Optional[str]:
    lib = library()
    return lib.spec_w4a8_kernel().decode() if lib is not None else None


def empty(out_features: int, in_features: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised weight, scale and min tensors of a packed layer (the shapes `pack` fills)."""
    blocks, G = -(-out_features // 16), in_features // GROUP
    weight = torch.empty(blocks, G, bits, 64, dtype=torch.uint8)
    if bits == 6:
        return weight, torch.empty(blocks, G, 32, dtype=torch.int8), torch.empty(blocks, G // 8, 16, dtype=torch.float16)
    return weight, torch.empty(blocks, G, 16, dtype=torch.float16), torch.empty(blocks, G, 16, dtype=torch.float16)


def pack(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bits: int = 4
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, K] (values below 2**bits, K a multiple of 32) and float scale/min [N, K / 32] -> the
    kernel's layout (kernels/cpu_w4a8.c): uint8 [blocks, G, bits, 64] (4, 6 or 8 vectors) and fp16 scale/min
    [blocks, G, 16], rows padded to blocks of 16 with zeros. For 6 bits (Q6_K: K a multiple of 256) the
    scales are int8 [N, K / 16] and `low` is d [N, K / 256]: int8 [blocks, G, 32] and fp16 [blocks, K / 256, 16]."""
    N, K = q.shape
    G, pad = K // GROUP, -N % 16
    q = torch.nn.functional.pad(q.to(torch.uint8), (0, 0, 0, pad))
    # [block, n, group, vector j, i] -> [block, group, j, n, i]
    vectors = q.view(-1, 16, G, 8, 4).permute(0, 2, 3, 1, 4)
    if bits == 8:
        packed = vectors
    else:
        low4 = vectors & 0x0F
        packed = low4[:, :, :4] | (low4[:, :, 4:] << 4)
    if bits == 6:
        high = (vectors >> 4).view(vectors.shape[0], G, 2, 4, 16, 4)            # vector 4 c + t
        high = sum(high[:, :, :, t] << (2 * t) for t in range(4))
        packed = torch.cat([packed, high], 2)

    def per_block(t: torch.Tensor, dtype=torch.float16) -> torch.Tensor:
        t = torch.nn.functional.pad(t if dtype == torch.int8 else t.float(), (0, 0, 0, pad))
        return t.view(-1, 16, t.shape[1]).transpose(1, 2).to(dtype).contiguous()

    if bits == 6:           # [block, n, group, half] -> [block, group, half, n]
        scales = per_block(scale, torch.int8).view(-1, G, 2, 16).reshape(-1, G, 32)
        return packed.reshape(packed.shape[0], G, -1, 64).contiguous(), scales, per_block(low)
    return packed.reshape(packed.shape[0], G, -1, 64).contiguous(), per_block(scale), per_block(low)


def unpack(weight: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, out_features: int) -> torch.Tensor:
    """The float weights [N, K] the packed layout holds (q * scale + min, or for 6 bits
    d * scale * (q - 32), as the kernel computes them)."""
    B, G, bits = weight.shape[:3]
    v = weight.view(B, G, -1, 16, 4)
    if bits != 8:                                                       # split the nibbles
        v = torch.cat([v[:, :, :4] & 0x0F, v[:, :, :4] >> 4], 2)
    if bits == 6:
        high = weight.view(B, G, -1, 16, 4)[:, :, 4:]
        v = v | torch.cat([((high[:, :, c:c + 1] >> (2 * t)) & 3) << 4 for c in range(2) for t in range(4)], 2)
    q = v.permute(0, 3, 1, 2, 4).reshape(B * 16, G, GROUP).float()
    if bits == 6:
        sc = scale.view(B, G, 2, 16).permute(0, 3, 1, 2).reshape(B * 16, G, 2, 1).float()
        d = low.float().transpose(1, 2).reshape(B * 16, -1).repeat_interleave(8, 1).view(B * 16, G, 1, 1)
        return ((q - 32).view(B * 16, G, 2, 16) * (d * sc)).view(B * 16, -1)[:out_features]
    per_row = (lambda t: t.transpose(1, 2).reshape(B * 16, G, 1).float())
    return (q * per_row(scale) + per_row(low)).view(B * 16, -1)[:out_features]


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
           bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """x [..., K] (fp32 or bf16) times packed weights (`pack`, 4, 6 or 8 bits) of `out_features` rows, plus
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
                 bias is not None and bias.dtype == torch.bfloat16, weight.data_ptr(), scale.data_ptr(),
                 low.data_ptr(), bias.data_ptr() if bias is not None else None)


def call(layer: Layer, x: torch.Tensor) -> torch.Tensor:
    """Eager calls: the kernel on x with a layer's struct, and as little Python around it as can be (a
    layer runs ~100 times a token)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"w4a8 CPU kernel unavailable: {failure()}")
    rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, layer.K).contiguous()
    out = torch.empty((rows.shape[0], layer.N), dtype=x.dtype)
    if rows.shape[0] == 0:
        return out.view(*x.shape[:-1], layer.N)
    rc = lib.spec_w4a8_linear(ctypes.byref(layer), rows.data_ptr(), x.dtype == torch.bfloat16, rows.shape[0],
                              out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError("w4a8_linear: out of memory" if rc == -1 else "w4a8_linear: K is not a multiple of 32 (of 256 for 6 bits)")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], layer.N)


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


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
              bias: Optional[torch.Tensor], bits: int = 4) -> torch.Tensor:
    """The same product in float64 from q [N, K] and float scale/min (for 6 bits, int8 scales per 16 and
    d per 256) (tests): the activations rounded to int8 groups as the kernel does, everything after that exact."""
    x8, dx = quantize_activations(x.reshape(-1, q.shape[1]))
    xs = (x8.double().view(x8.shape[0], -1, GROUP) * dx.double()[..., None]).view(x8.shape)
    if bits == 6:
        step = scale.double() * low.double().repeat_interleave(16, 1)
        w = ((q.double() - 32).view(q.shape[0], -1, 16) * step[..., None]).view(q.shape)
    else:
        w = (q.double().view(q.shape[0], -1, GROUP) * scale.double()[..., None] + low.double()[..., None]).view(q.shape)
    y = xs @ w.t()
    if bias is not None:
        y = y + bias.double()
    return y.view(*x.shape[:-1], q.shape[0])
