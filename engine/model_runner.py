"""ModelRunner: loads a model, owns its KV memory, and turns scheduled work into one forward pass."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from engine.attention import create_backend
from engine.config import ServerArgs
from engine.errors import ConfigError, ModelLoadError
from engine.forward_batch import ForwardItem, build_forward_batch
from engine.memory.kv_pool import KVPool, ReqToTokenPool, TokenSlotAllocator
from engine.models import model_class
from engine.models.prepack import can_prepack, native_bf16

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is available; use --device cpu.")
    return name


def resolve_dtype(name: str, config, device: str) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    ckpt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    ckpt = _DTYPES.get(str(ckpt).replace("torch.", ""), torch.float32) if ckpt is not None else torch.float32
    if device == "cpu":
        # fp16 matmuls are slow on CPU; bf16 halves the memory read per token where the CPU computes it
        # natively (AMX / AVX-512-BF16), and is several times slower than fp32 where it does not.
        return torch.bfloat16 if ckpt != torch.float32 and native_bf16(device) else torch.float32
    return ckpt


@dataclass
class ForwardOutput:
    logits: torch.Tensor                 # [R, V] fp32 for the requested rows
    hidden: torch.Tensor                 # [T, H] final normed hidden states of all new tokens
    captured: dict[int, torch.Tensor]    # requested hidden states by index


class ModelRunner:
    def __init__(self, args: ServerArgs, model_dir, config, *, kv_pool_tokens: Optional[int] = None,
                 max_requests: Optional[int] = None):
        self.args = args
        self.model_dir = model_dir
        self.device = resolve_device(args.device)
        self.config = config
        self.dtype = resolve_dtype(args.dtype, config, self.device)
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        self.context_len = args.context_length
        cls = model_class(config, str(model_dir))
        with torch.device(self.device):
            model = cls(config, max_positions=self.context_len + 64)
        model.to(self.dtype)
        # The rotary tables stay fp32 so positions far out keep their precision.
        model.model.rotary.float()
        from engine.loader import iter_weights

        try:
            model.load_weights(iter_weights(model_dir))
        except KeyError as exc:
            raise ModelLoadError(f"{model_dir}: weights do not match the {config.architectures[0]} config: {exc.args[0]}. "
                                 "Pass a complete checkpoint.") from None
        self.model = model.eval()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if can_prepack(self.device, self.dtype):
            self.weight_bytes += self._prepack()

        attn = model.model.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        tokens = kv_pool_tokens or self._pool_tokens()
        self.max_requests = max_requests or args.max_running_requests or (256 if self.device == "cuda" else 32)
        self.kv_pool = KVPool(model.num_layers, tokens, self.num_kv_heads, self.head_dim, self.dtype, self.device)
        self.allocator = TokenSlotAllocator(tokens)
        # Spare rows: retracted and chunked requests can hold one while the batch is full.
        self.req_to_token = ReqToTokenPool(self.max_requests + 8, self.context_len + 64 + (args.speculative_num_draft_tokens or 0),
                                           self.device)
        self.backend = create_backend(args.attention_backend, self.device, self.kv_pool, self.req_to_token)
        log.info("model %s: %s, %.0f MiB of weights; KV pool %d tokens (%.0f MiB)", model_dir, self.dtype,
                 self.weight_bytes / 2**20, tokens, tokens * self.kv_bytes_per_token / 2**20)

    def _prepack(self) -> int:
        import psutil

        # The packed copies about double the weights; without room for them, stay on F.linear.
        if psutil.virtual_memory().available < 2 * self.weight_bytes:
            log.warning("not enough free memory for prepacked CPU weights (%.0f MiB more); batched matmuls "
                        "will be slower", self.weight_bytes / 2**20)
            return 0
        return self.model.prepack()

    @property
    def kv_bytes_per_token(self) -> int:
        return KVPool.bytes_per_token(self.model.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def _pool_tokens(self) -> int:
        args = self.args
        if args.max_total_tokens:
            return args.max_total_tokens
        if self.device == "cuda":
            free, total = torch.cuda.mem_get_info()
            fraction = args.mem_fraction_static or 0.88
        else:
            import psutil

            total = psutil.virtual_memory().total
            fraction = args.mem_fraction_static or 0.3
        budget = int(total * fraction) - self.weight_bytes
        if budget < 64 * self.kv_bytes_per_token:
            raise ConfigError(
                f"The weights take {self.weight_bytes / 2**30:.2f} GiB, leaving no KV cache within "
                f"--mem-fraction-static {fraction} of {total / 2**30:.1f} GiB. Raise --mem-fraction-static "
                "or pass --max-total-tokens.")
        return budget // self.kv_bytes_per_token

    # ------------------------------------------------------------------------------------------
    def forward(self, items: Sequence[ForwardItem], out_slots: torch.Tensor, logit_rows: torch.Tensor,
                capture_hidden: tuple[int, ...] = ()) -> ForwardOutput:
        """Run the model over every item's new tokens (their KV slots already allocated in
        `out_slots`, in order) and return logits for the flat token indices `logit_rows`."""
        batch = build_forward_batch(items, out_slots, self.req_to_token.table, capture_hidden)
        self.backend.prepare(batch)
        with torch.inference_mode():
            hidden, captured = self.model(batch.input_ids, batch.positions, batch, self.backend)
            logits = self.model.compute_logits(hidden[logit_rows.to(self.device)])
        return ForwardOutput(logits.cpu(), hidden, captured)
