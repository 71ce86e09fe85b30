"""ModelRunner: one model, its own K/V buffers and attention backend; turns a ForwardBatch into logits
and hidden states on the model's device. Loading a target model is here too."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from engine.errors import ConfigError, ModelLoadError
from engine.core.forward_batch import ForwardBatch
from engine.loader.fp8_quant import checkpoint_of
from engine.memory.kv_pool import KVPool
from engine.models import model_class
from engine.models.moe import stack_experts
from engine.models.prepack import can_prepack, native_bf16

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is available; use --device cpu.")
    return name


def resolve_dtype(name: str, config, device: str, quantized: bool = False) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if quantized:       # the int4/int8 kernels take bf16 activations; elsewhere they are converted
        return torch.bfloat16 if native_bf16(device) else torch.float32
    ckpt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    ckpt = _DTYPES.get(str(ckpt).replace("torch.", ""), torch.float32) if ckpt is not None else torch.float32
    if device == "cpu":
        # fp16 matmuls are slow on CPU; bf16 halves the memory read per token where the CPU computes it
        # natively (AMX / AVX-512-BF16), and is several times slower than fp32 where it does not.
        return torch.bfloat16 if ckpt != torch.float32 and native_bf16(device) else torch.float32
    return ckpt


# oneDNN's int8 GEMM has a fixed cost per call, whatever its size, several times torch's int4 kernel's:
# below about this many weights per MLP projection that fixed cost dominates and int4 decodes faster
# (SmolLM2-135M, 0.9M), above it int8's reads win and its flat cost over rows makes verification nearly
# free (Qwen2.5-1.5B, 13.8M).
# Both only where our w4a8 kernel has no VNNI path (it beats both at every size where it does).
_W8A8_MIN_WEIGHTS = 2_000_000


def resolve_quantization(name: str, model_dir, device: str, dtype: str, config=None) -> Optional[str]:
    """What --quantization (or the draft's) means for this model: a kind of engine/models/quant.py, or
    None. auto: a GGUF (its converted directory keeps the file's own blocks) or an MXFP4 checkpoint (its
    experts' blocks) on the CPU, unless float32 is asked for: w4a8 where its kernel runs on VNNI, else the
    format that decodes it faster (see _W8A8_MIN_WEIGHTS)."""
    from engine.loader import quantized_groups
    from engine.models.quant import KINDS
    from spec_kernels import cpu_w4a8

    if name == "fp8" or (name == "auto" and checkpoint_of(model_dir) is not None):
        return _fp8(name, model_dir, device)
    if name in KINDS:
        if device != "cpu":
            raise ConfigError(f"--quantization {name} runs on the CPU only so far (CPU int8/int4 kernels); "
                              "on a GPU leave it out.")
        if name == "w4a8" and cpu_w4a8.library() is None:
            raise ConfigError(f"--quantization w4a8 needs its C kernel, which could not be built: "
                              f"{cpu_w4a8.failure()}. Install a C compiler (gcc) or set CC, or pick int4 or w8a8_int8.")
        if name == "w4a8" and dtype == "float16":
            raise ConfigError("--quantization w4a8 takes bfloat16 or float32 activations: drop --dtype float16, "
                              "or pick int4 or w8a8_int8.")
        return name
    if name != "auto" or device != "cpu" or dtype == "float32" or quantized_groups(model_dir) is None:
        return None
    if cpu_w4a8.kernel_name() == "avx512-vnni" and dtype != "float16":
        return "w4a8"
    size = getattr(config, "hidden_size", 0) * getattr(config, "intermediate_size", 0)
    return "w8a8_int8" if size >= _W8A8_MIN_WEIGHTS and torch.backends.mkldnn.is_available() else "int4"


def _fp8(name: str, model_dir, device: str) -> Optional[str]:
    """FP8 e4m3 layers (engine/models/fp8.py) on CUDA: an FP8 checkpoint's as stored, or a float one's
    rounded (--quantization fp8). An FP8 checkpoint elsewhere (a CPU, tensor parallelism) and under
    --quantization none is dequantized while loading (load_model)."""
    from engine.distributed import group as tp

    where = "a CPU" if device != "cuda" else "tensor parallelism" if tp.building() is not None else None
    if name == "fp8" and where:
        raise ConfigError(f"--quantization fp8 runs on one CUDA GPU: FP8 GEMMs (torch._scaled_mm) need compute "
                          f"capability 8.9 or later (older cards multiply weight-only), and FP8 layers are not sharded "
                          f"for tensor parallelism. On {where} leave it out"
                          + (" (an FP8 checkpoint loads dequantized)." if checkpoint_of(model_dir) else
                             ", or on a CPU pick w4a8, w8a8_int8 or int4."))
    return None if where else "fp8"


def load_model(model_dir, config, dtype: torch.dtype, device: str, max_positions: int,
               prepack: bool = True, quantization: Optional[str] = None, draft: bool = False) -> nn.Module:
    """Build the target architecture on `device` and load its weights, quantized as `quantization`
    says (engine/models/quant.py: the decoder's linears as they are read, so the float model never
    exists whole; a GGUF's own blocks and an MXFP4 checkpoint's experts as quant.install_gguf_groups says, exactly);
    the remaining CPU linears are prepacked when there is memory for it and `prepack`
    (engine/models/prepack.py; a compiled model packs its own). Under tensor parallelism the model is
    this rank's block. A `draft` is quantized as quant.DRAFT_HEADS says. `model.weight_bytes` tells what it holds."""
    from engine.distributed.sharding import local_config, local_groups
    from engine.loader import iter_weights, quantized_groups
    from engine.models.fp8 import describe as fp8_paths, fp8_sinks
    from engine.models.quant import (BESIDE_GROUPS, FROM_GROUPS, install_gguf_groups, quantize_while_loading,
                                     release_freed_memory)

    cls = model_class(config, str(model_dir))
    # Built on the meta device: a float model initialised in full would be resident before loading
    # overwrites it (Qwen2.5-1.5B: 6 GB in fp32, most of it never read when quantized).
    # Built at this rank's sizes under tensor parallelism; the config stays whole.
    with torch.device("meta"):
        model = cls(local_config(config), max_positions=max_positions)
    model.config = config
    model.to(dtype)
    materialize(model, device)
    groups = quantized_groups(model_dir) if quantization in FROM_GROUPS else None
    provided = install_gguf_groups(model, local_groups(groups), quantization, draft) if groups else set()
    provided = groups.sources(provided) if groups else provided      # the checkpoint's names of what they hold
    # A draft's GGUF layers stored above 4 bits are rounded to its kind too (quant.DRAFT_HEADS says why).
    beside = quantization if draft else BESIDE_GROUPS.get(quantization)
    fp8 = checkpoint_of(model_dir)
    if quantization == "fp8":
        sinks = fp8_sinks(model, online=fp8 is None)
    else:
        sinks = quantize_while_loading(model, beside if groups else quantization, draft) if quantization else {}
        if fp8 is not None:
            log.info("%s: FP8 checkpoint (%s) dequantized to %s while loading (FP8 layers run on one CUDA GPU, "
                     "unless --quantization none)", model_dir, fp8.describe(), dtype)
    try:
        model.load_weights(iter_weights(model_dir, select=lambda name: name not in provided,
                                        keep_fp8=quantization == "fp8"), sinks)
    except KeyError as exc:
        kind = (getattr(config, "architectures", None) or [config.model_type])[0]
        raise ModelLoadError(f"{model_dir}: weights do not match the {kind} config: {exc.args[0]}. "
                             "Pass a complete checkpoint.") from None
    release_freed_memory()
    if quantization == "fp8":
        log.info("%s: FP8 layers (%s): %s", model_dir, fp8.describe() if fp8 else "rounded per output channel",
                 fp8_paths(model))
    model.eval()
    if str(device).startswith("cuda"):
        stack_experts(model)
    model.weight_bytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    if prepack and can_prepack(device, dtype):
        import psutil

        # The packed copies about double the weights; without room for them, stay on F.linear.
        if psutil.virtual_memory().available < 2 * model.weight_bytes:
            log.warning("not enough free memory for prepacked CPU weights (%.0f MiB more); batched matmuls "
                        "will be slower", model.weight_bytes / 2**20)
        else:
            model.weight_bytes += model.prepack()
    return model


def materialize(model: nn.Module, device) -> None:
    """Give a model built on the meta device uninitialised storage on `device`, whose pages stay
    untouched until loading writes them (every parameter is loaded or replaced), and its rotary
    tables, which stay fp32 so positions far out keep their precision."""
    from engine.models.llama import Rotary

    for module in model.modules():
        if isinstance(module, Rotary):
            module.build(device)
            continue
        for name, param in module.named_parameters(recurse=False):
            module._parameters[name] = nn.Parameter(torch.empty_like(param, device=device), requires_grad=False)
        for name, buf in module.named_buffers(recurse=False):
            module._buffers[name] = torch.empty_like(buf, device=device)


def kv_layout(model: nn.Module) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of the K/V a model keeps per token."""
    attn = model.attention
    return getattr(model, "num_layers", 1), attn.num_kv_heads, attn.head_dim


def kv_windows(model: nn.Module) -> list[Optional[int]]:
    """Each layer's sliding window (None: it attends to everything), as its attention holds it."""
    return [getattr(layer.self_attn, "window", None) for layer in model.model.layers]


@dataclass
class ForwardOutput:
    logits: Optional[torch.Tensor]       # [R, V] fp32 for the requested rows, on the device
    hidden: torch.Tensor                 # [T, H] final normed hidden states of all new tokens
    captured: dict[int, torch.Tensor]    # requested hidden states by index


class ModelRunner:
    def __init__(self, model: nn.Module, kv_pool: KVPool, backend):
        self.model, self.kv_pool, self.backend = model, kv_pool, backend
        self.graphs = None          # StepGraphs for decode steps (engine/core/graph_runner.py), when enabled
        self.leader = None          # tensor parallelism's rank 0 (engine/distributed/mirror.py), when on

    def run_model(self, batch: ForwardBatch):
        return self.model(batch.input_ids, batch.positions, batch, self.backend)

    def forward(self, batch: ForwardBatch, logit_rows: Optional[torch.Tensor] = None,
                all_logits: bool = False, decode: bool = False) -> ForwardOutput:
        """Run the model over the batch's new tokens; logits for the flat token indices `logit_rows`
        (or for every token with `all_logits`). A `decode` step runs at a bucketed shape when graphs
        are enabled. Under tensor parallelism rank 0 announces the forward first: every other rank runs
        the same one on its shard of the weights."""
        if self.leader is not None:
            return self.leader.target(self._forward, batch, logit_rows, all_logits, decode)
        return self._forward(batch, logit_rows, all_logits, decode)

    def _forward(self, batch: ForwardBatch, logit_rows: Optional[torch.Tensor], all_logits: bool,
                 decode: bool) -> ForwardOutput:
        batch.decode_step = decode
        size = self.graphs.bucket(batch) if decode and self.graphs is not None else None
        if size is None:
            self.backend.prepare(batch)
            hidden, captured = self.run_model(batch)
        else:
            hidden, captured = self.graphs.run(batch, size)
        rows = hidden if all_logits else None if logit_rows is None else hidden[logit_rows]
        return ForwardOutput(None if rows is None else self.model.compute_logits(rows), hidden, captured)
