"""4- or 8-bit weight groups x 8-bit activations on the CPU: kernels/cpu_w4a8.c, built once per machine
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


def pack(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bits: int = 4
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, K] (values below 2**bits, K a multiple of 32) and float scale/min [N, K / 32] -> the
    kernel's layout (kernels/cpu_w4a8.c): uint8 [blocks, G, bits, 64] (4 or 8 vectors) and fp16 scale/min
    [blocks, G, 16], rows padded to blocks of 16 with zeros."""
    N, K = q.shape
    G, pad = K // GROUP, -N % 16
    q = torch.nn.functional.pad(q.to(torch.uint8), (0, 0, 0, pad))
    # [block, n, group, vector j, i] -> [block, group, j, n, i]
    vectors = q.view(-1, 16, G, 8, 4).permute(0, 2, 3, 1, 4)
    packed = vectors if bits == 8 else vectors[:, :, :4] | (vectors[:, :, 4:] << 4)

    def per_block(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t.float(), (0, 0, 0, pad)).view(-1, 16, G).transpose(1, 2).half().contiguous()

    return packed.reshape(packed.shape[0], G, -1, 64).contiguous(), per_block(scale), per_block(low)


def unpack(weight: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, out_features: int) -> torch.Tensor:
    """The float weights [N, K] the packed layout holds (q * scale + min, as the kernel computes them)."""
    B, G = weight.shape[:2]
    v = weight.view(B, G, -1, 16, 4)
    if weight.shape[2] == 4:                                            # 4-bit: split the nibbles
        v = torch.cat([v & 0x0F, v >> 4], 2)
    q = v.permute(0, 3, 1, 2, 4).reshape(B * 16, G, GROUP).float()
    per_row = (lambda t: t.transpose(1, 2).reshape(B * 16, G, 1).float())
    return (q * per_row(scale) + per_row(low)).view(B * 16, -1)[:out_features]


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
           bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """x [..., K] (fp32 or bf16) times packed weights (`pack`, 4 or 8 bits) of `out_features` rows, plus
    bias (fp32, bf16 or None; added in fp32 before the result is rounded to x's dtype): [..., N]."""
    if torch.compiler.is_compiling():
        return torch.ops.spec.w4a8_linear(x, weight, scale, low, bias, out_features)
    return call(layer(weight, scale, low, bias, out_features), x)


def layer(weight: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bias: Optional[torch.Tensor],
          out_features: int) -> Layer:
    """The C struct of a packed layer: it points into the tensors, which must outlive it unchanged."""
    if bias is not None:
        assert bias.dtype in (torch.float32, torch.bfloat16) and bias.is_contiguous()
    return Layer(weight.shape[1] * GROUP, out_features, 4 if weight.shape[2] == 4 else 8,
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
        raise RuntimeError("w4a8_linear: out of memory" if rc == -1 else "w4a8_linear: K is not a multiple of 32")
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
              bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The same product in float64 from q [N, K] and float scale/min (tests): the activations
    rounded to int8 groups as the kernel does, everything after that exact."""
    x8, dx = quantize_activations(x.reshape(-1, q.shape[1]))
    xs = (x8.double().view(x8.shape[0], -1, GROUP) * dx.double()[..., None]).view(x8.shape)
    w = (q.double().view(q.shape[0], -1, GROUP) * scale.double()[..., None] + low.double()[..., None]).view(q.shape)
    y = xs @ w.t()
    if bias is not None:
        y = y + bias.double()
    return y.view(*x.shape[:-1], q.shape[0])
