"""GGUF's quantized blocks as the engine's CPU kernels take them (`Groups`).

4 bits, as groups of 32 weights: w = q * scale + min, q in 0..15. Q4_0 (d; w = d * (q - 8)) and Q4_1
(d, m; w = d * q + m) have this form with fp32 scale and min per 32 weights. Q4_K keeps its own:
super-blocks of 256 with fp16 d and dmin, and per 32 a 6-bit scale sc and min m: w = d * sc * q - dmin * m
(`scale_min` gives the fp32 scale and min per 32 that is, exactly).
5 bits, q in 0..31: Q5_K with Q4_K's scales and mins; Q5_0 (d; w = d * (q - 16)) and Q5_1 (d, m;
w = d * q + m) with fp32 scale and min per 32; and MXFP4 (GPT-OSS's experts: an e8m0 exponent e and 32
e2m1 values v, w = v * 2^(e - 127)), whose doubled values 2v are integers in -12..12: q = 2v + 12 with
scale 2^(e - 128) and min -12 * scale, exact in fp32.
6 bits, Q6_K as it is: w = d * sc * (q - 32), q in 0..63, an int8 sc per 16 weights, an fp16 d per 256.
8 bits, groups of 32 again: Q8_0 (d; w = d * q8, stored as q8 + 128 with min -128 d).
`dequantize` of what `decode` gives equals gguf's own dequantization bit for bit (tests/test_quant.py).
The engine serves these with its int4 kernels and its w4a8 kernel (engine/models/quant.py). Other
types (Q2_K, Q3_K, IQ*) are left to the dequantized checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
import torch

from engine.loader.safetensors_io import SafetensorsFile

GROUP = 32
_SLICE_BYTES = 16 << 20         # dequantize's output per slice


class Groups(NamedTuple):
    """A GGUF tensor's own weights, [N, K] by rows. 4 bits: q packed two to a byte [N, K / 2] (`pack`),
    scale and min [N, K / 32]: fp32, or Q4_K's uint8 sc and m with `super` its fp16 (d, dmin)
    [N, K / 256, 2]. 5 bits: q [N, K] in 0..31 with Q4_K's scales, or fp32 scale and min [N, K / 32]. 6 bits: q [N, K] in 0..63, int8
    scales [N, K / 16], `super` d [N, K / 256, 1].
    8 bits: q [N, K] uint8, fp32 scale and min [N, K / 32]."""
    bits: int
    q: torch.Tensor
    scale: torch.Tensor
    low: Optional[torch.Tensor]
    super: Optional[torch.Tensor] = None

    @property
    def columns(self) -> int:
        """K: the weights a row holds."""
        return self.q.shape[1] * (2 if self.bits == 4 else 1)

    def scale_min(self) -> tuple[torch.Tensor, torch.Tensor]:
        """4, 5 and 8 bits: fp32 scale and min [N, K / 32], exact (fp16 d times a 6-bit sc fits fp32)."""
        if self.super is None:
            return self.scale.float(), self.low.float()
        d, dmin = (self.super[..., i].float().repeat_interleave(8, 1) for i in range(2))
        return d * self.scale.float(), -(dmin * self.low.float())

    def map(self, fn) -> "Groups":
        """The same groups with fn applied to each tensor (all of them have N rows)."""
        return Groups(self.bits, *(None if t is None else fn(t) for t in self[1:]))


def decodable(type_name: str) -> bool:
    return type_name in ("Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q5_1", "MXFP4")


def decode(raw: np.ndarray, type_name: str, rows: int) -> Groups:
    """A tensor's raw GGUF blocks (uint8, rows x bytes per row) -> its Groups."""
    blocks = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q8_0": 34, "Q5_0": 22,
              "Q5_1": 24, "MXFP4": 17}[type_name]
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, blocks)
    sup = None
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    if type_name == "Q6_K":
        q, scale, low, sup = _q6_k(b)
    elif type_name in ("Q4_K", "Q5_K"):
        q, scale, low, sup = _k_quant(b, type_name == "Q5_K")
    elif type_name == "Q8_0":
        q, scale, low = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), d, -128 * d
    elif type_name == "MXFP4":
        q, scale, low = _mxfp4(b)
    elif type_name in ("Q5_0", "Q5_1"):
        q, scale = _five_bits(b[:, 2:] if type_name == "Q5_0" else b[:, 4:]), d
        low = -16 * d if type_name == "Q5_0" else b[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    else:
        nibbles = b[:, 2:] if type_name == "Q4_0" else b[:, 4:]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1)            # [blocks, 32]
        scale = d
        low = (-8.0 * d).astype(np.float32) if type_name == "Q4_0" else \
            b[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    q = q.reshape(rows, -1)
    bits = {"Q5_K": 5, "Q6_K": 6, "Q8_0": 8, "Q5_0": 5, "Q5_1": 5, "MXFP4": 5}.get(type_name, 4)
    return Groups(bits, pack(q) if bits == 4 else torch.from_numpy(q),
                  *(None if t is None else torch.from_numpy(np.ascontiguousarray(t)).reshape(rows, -1, *t.shape[2:])
                    for t in (scale, low, sup)))


def _five_bits(b: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4 bytes of high bits (weight i's is bit i) and 16 of low nibbles (weights 0-15 low, 16-31
    high) -> q [blocks, 32] in 0..31."""
    high = (b[:, :4].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
    low = np.concatenate([b[:, 4:20] & 0x0F, b[:, 4:20] >> 4], axis=1)
    return (low | (high.astype(np.uint8) << 4)).astype(np.uint8)


# e2m1 codes (sign bit 3) -> twice their value.
_E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int16)


def _mxfp4(b: np.ndarray) -> tuple[np.ndarray, ...]:
    """MXFP4 as GGUF stores it: the exponent byte, then 16 bytes of codes (weights 0-15 low nibbles, 16-31
    high) -> 5-bit q [blocks, 32], scale and min [blocks]."""
    return e2m1(np.concatenate([b[:, 1:] & 0x0F, b[:, 1:] >> 4], axis=1), b[:, 0])


def e2m1(codes: np.ndarray, exponents: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MXFP4's e2m1 codes [..., 32 a group] and e8m0 exponents [..., one a group] -> the 5-bit form above:
    q (uint8, codes' shape), scale and min (fp32, exponents' shape). Exponents past 247 (weights of 2^120
    and more) come near overflowing q * scale in fp32: no model has them, a damaged file may."""
    if exponents.max(initial=0) > 247:
        raise ValueError(f"an MXFP4 block's exponent is {int(exponents.max())}, its weights beyond 2^120: "
                         "the file is damaged")
    scale = np.ldexp(np.float32(1), exponents.astype(np.int32) - 128).astype(np.float32)
    return (_E2M1_DOUBLED[codes] + 12).astype(np.uint8), scale, -12 * scale


def _k_quant(b: np.ndarray, five: bool) -> tuple[np.ndarray, ...]:
    """Q4_K: d, dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles. Q5_K: the same with 32 bytes of
    high bits before the nibbles, bit j of byte l being weight l's of sub-block j."""
    import gguf

    nb = b.shape[0]
    sc, mn = gguf.quants.Q4_K.get_scale_min(b[:, 4:16])                         # [nb, 8] each
    # 128 bytes: 4 chunks of 32; a chunk's low nibbles are sub-block 2c, its high nibbles 2c + 1.
    nibbles = b[:, 48 if five else 16:].reshape(nb, 4, 1, 32)
    q = ((nibbles >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(nb, 256)
    if five:
        high = (b[:, 16:48].reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        q |= (high << 4).reshape(nb, 256)
    return q, sc.astype(np.uint8), mn.astype(np.uint8), b[:, 0:4].copy().view(np.float16).reshape(nb, 1, 2)


def _q6_k(b: np.ndarray) -> tuple[np.ndarray, ...]:
    # 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales, fp16 d. Each half of 128 weights: its 64
    # low-nibble bytes give weights 0-63 (low nibbles) and 64-127 (high nibbles); its 32 high-bit bytes,
    # 2 bits for each quarter of 32.
    nb = b.shape[0]
    low = (b[:, :128].reshape(nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (b[:, 128:192].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = low.reshape(nb, 256) | (high.reshape(nb, 256) << 4)
    return q, b[:, 192:208].copy().view(np.int8), None, b[:, 208:210].copy().view(np.float16).reshape(nb, 1, 1)


def pack(q: np.ndarray) -> torch.Tensor:
    """q [N, K] in 0..15 -> uint8 [N, K / 2]: byte j holds q[:, 2j] (low nibble) and q[:, 2j + 1]."""
    q = torch.from_numpy(np.ascontiguousarray(q)).to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] -> q [N, K] (uint8)."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def dequantize(groups: Groups) -> torch.Tensor:
    """float32 weights [N, K] of a tensor's groups, as GGUF computes them, in slices of 16 MiB of output:
    the temporaries are several times what a slice returns (a 150k-row embedding is ~1 GB in fp32)."""
    rows, columns = groups.q.shape[0], groups.columns
    step = max(1, _SLICE_BYTES // (4 * max(1, columns)))
    if rows <= step:                # an embedding's lookup: no copy
        return _dequantize(groups)
    out = torch.empty(rows, columns)
    for r in range(0, rows, step):
        out[r:r + step] = _dequantize(groups.map(lambda t: t[r:r + step]))
    return out


def _dequantize(groups: Groups) -> torch.Tensor:
    if groups.bits == 6:
        q, d = groups.q.float() - 32, groups.super[..., 0].float().repeat_interleave(16, 1)
        return (q.view(q.shape[0], -1, 16) * (d * groups.scale.float())[..., None]).view(q.shape)
    scale, low = groups.scale_min()
    q = (unpack(groups.q) if groups.bits == 4 else groups.q).float().view(groups.q.shape[0], -1, GROUP)
    return (q * scale[:, :, None] + low[:, :, None]).view(groups.q.shape[0], -1)


# Where a converted GGUF keeps its own quantized tensors (gguf_convert.py writes it).
QUANT_FILE = "gguf_groups/groups.safetensors"


def gguf_groups(model_dir: Path) -> Optional["StoredGroups"]:
    """A converted GGUF's own quantized tensors, or None when the directory has none."""
    file = Path(model_dir) / QUANT_FILE
    return StoredGroups(file) if file.is_file() else None


class StoredGroups:
    """hf weight name -> Groups (None for a name stored otherwise), over QUANT_FILE."""

    def __init__(self, file: Path):
        self._reader = SafetensorsFile(file)

    def names(self) -> list[str]:
        return [n.rsplit(".", 1)[0] for n in self._reader.names() if n.rsplit(".", 1)[1] in _BITS]

    def sources(self, provided: set[str]) -> set[str]:
        """The checkpoint's tensors that hold nothing but what `provided` (names given as groups) holds:
        the same names here."""
        return provided

    def __call__(self, name: str):
        for bits in _BITS.values():
            names = [f"{name}.q{bits}{suffix}" for suffix in ("", "_scale", "_min", "_super")]
            if names[0] in self._reader.header:
                return Groups(bits, *(self._reader.get(n) if n in self._reader.header else None for n in names))
        return None


_BITS = {f"q{bits}": bits for bits in (4, 5, 6, 8)}
