"""Assembles an engine from ServerArgs: model source, config resolved once, target and draft models,
the KV memory budget, the KV manager, the worker and the scheduler."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional
from weakref import WeakKeyDictionary

import torch
from torch import nn

from engine.attention import check_backend, create_backend
from engine.config import ServerArgs, model_max_positions
from engine.core.cost_probe import forward_times
from engine.distributed import group as tp
from engine.core.graph_runner import attach
from engine.loader import load_config, load_tokenizer, resolve_model_path
from engine.memory.budget import MIN_SLOTS, KVBudget, slot_bytes, window_slots
from engine.memory.kv_manager import KVManager
from engine.memory.kv_pool import KVPool
from engine.memory.window_pool import SlidingLayout
from engine.core.model_runner import (ModelRunner, kv_layout, kv_windows, load_model, resolve_device, resolve_dtype,
                                      resolve_quantization)
from engine.progress import progress
from engine.core.scheduler import Scheduler
from engine.speculative.cost import StepCost
from engine.speculative.planner import PRIOR_ROW_COST, Planner, PlannerFactory
from engine.speculative.factory import create_drafter, load_draft_model, unseeded_rule
from engine.speculative.token_map import resolve_token_map
from engine.core.worker import Worker

log = logging.getLogger(__name__)

# Table rows beyond the running batch: retracted and chunk-prefilling requests can hold one meanwhile.
_SPARE_ROWS = 8


@dataclass
class EngineParts:
    args: ServerArgs              # resolved against the model
    model_dir: Path
    model_config: object
    tokenizer: object
    kv: KVManager
    target: ModelRunner
    draft: Optional[nn.Module]
    scheduler: Scheduler
    eos_ids: list[int]


def eos_token_ids(model_dir: Path, config, tokenizer) -> list[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer (chat models often list several)."""
    ids: list = []
    try:
        from transformers import GenerationConfig

        ids.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    except (OSError, ValueError):
        pass
    ids += [getattr(config, "eos_token_id", None), tokenizer.eos_token_id]
    flat: list[int] = []
    for x in ids:
        for t in (x if isinstance(x, (list, tuple)) else [x]):
            if isinstance(t, int) and t not in flat:
                flat.append(t)
    return flat


def device_memory(device: str) -> tuple[int, int]:
    """(free, total) bytes of the device's memory, RAM on CPU."""
    if device == "cuda":
        return torch.cuda.mem_get_info()
    import psutil

    memory = psutil.virtual_memory()
    return memory.available, memory.total


def kv_budget(args: ServerArgs, device: str, weight_bytes: int, bytes_per_token: int) -> KVBudget:
    """KV slots that fit --mem-fraction-static of the device's memory once the weights (target and
    draft) are in, each slot holding the target's and the draft's K/V of one token; or --max-total-tokens."""
    _, total = device_memory(device)
    if device == "cpu":
        total //= args.ranks_per_node       # tensor-parallel ranks on one machine share its RAM
    fraction = args.mem_fraction_static or (0.88 if device == "cuda" else 0.3)
    budget = KVBudget.plan(args.max_total_tokens, fraction, total, weight_bytes, bytes_per_token,
                           full_request_slots(args))
    budget.slots = tp.agree_min(budget.slots)   # tensor-parallel ranks size their pools alike
    budget.warn_if_short(full_request_slots(args), args.context_length)
    return budget


def full_request_slots(args: ServerArgs) -> int:
    """Slots one request of the whole context takes in its last step: its tokens and the tree verified."""
    return args.context_length + (args.speculative_num_draft_tokens or 1)


def sliding_layout(args: ServerArgs, target: nn.Module) -> Optional[SlidingLayout]:
    """The target's sliding-window layers, which keep their K/V in a pool of their own, freed as windows
    move on (engine/memory/window_pool.py); None where none has a window shorter than the context."""
    return SlidingLayout.of(kv_windows(target), args.context_length)


def window_ratio(args: ServerArgs) -> float:
    """Window pool slots per slot: --swa-full-tokens-ratio, or 1 without chunked prefill, where a whole
    prompt takes its window slots at once."""
    if args.chunked_prefill_size == 0:
        log.info("--chunked-prefill-size 0: the window pool holds as many tokens as the full pool, a whole prompt "
                 "being prefilled at once (--swa-full-tokens-ratio has no effect)")
        return 1.0
    return args.swa_full_tokens_ratio


def model_bytes(model: Optional[nn.Module]) -> int:
    if model is None:
        return 0
    return getattr(model, "weight_bytes", None) or sum(p.numel() * p.element_size() for p in model.parameters())


def resolve_args(args: ServerArgs, model_config, device: str) -> ServerArgs:
    """`args` resolved against the target's config and the device it runs on, a hub-style token map
    fetched: everything that can be refused is, before any weight loads."""
    args = args.resolved(model_config, device)
    if args.speculative_token_map:
        args = replace(args, speculative_token_map=resolve_token_map(args.speculative_token_map))
    return args


def build_engine_parts(args: ServerArgs, planners: Optional[PlannerFactory] = None) -> EngineParts:
    """The engine's parts; `planners` makes each worker's planner (a TimedPlanners unless given)."""
    device = resolve_device(args.device)
    check_backend(args.attention_backend, device, args.enable_deterministic_inference)   # before any file is read
    if device == "cpu":     # every kernel ready before the first request, and said which
        from spec_kernels.native import KERNELS, build_all
        log.info(build_all(lambda built: progress(built, "CPU kernels (built once per machine)", len(KERNELS))))
    model_dir = resolve_model_path(args.model_path, args.revision, args.trust_remote_code)
    config = load_config(model_dir, args.trust_remote_code)
    max_pos = model_max_positions(config)
    args = resolve_args(args, config, device)
    if args.context_length > max_pos:
        log.warning("--context-length %d exceeds the model's max_position_embeddings %d; outputs past it "
                    "may degrade", args.context_length, max_pos)
    tokenizer = load_tokenizer(args.tokenizer_path or model_dir, args.trust_remote_code)
    quantization = resolve_quantization(args.quantization, model_dir, device, args.dtype, config)
    dtype = resolve_dtype(args.dtype, config, device, quantized=quantization is not None)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    max_positions = args.max_positions
    target = load_model(model_dir, config, dtype, device, max_positions, prepack=not args.enable_torch_compile,
                        quantization=quantization)
    draft = load_draft_model(args, target, model_dir, dtype, device, max_positions)

    layers, heads, head_dim = kv_layout(target)
    sliding = sliding_layout(args, target)
    windowed, ratio = (len(sliding.layers), window_ratio(args)) if sliding else (0, 1.0)
    full = KVPool.bytes_per_token(layers - windowed, heads, head_dim, dtype)
    if draft is not None:
        full += KVPool.bytes_per_token(*kv_layout(draft), dtype)
    per_token = slot_bytes(full, KVPool.bytes_per_token(windowed, heads, head_dim, dtype), ratio)
    budget = kv_budget(args, device, model_bytes(target) + model_bytes(draft), per_token)
    slots = budget.slots
    local = window_slots(slots, ratio, sliding.window + args.prefill_chunk(device) + MIN_SLOTS) if sliding else 0
    max_running = args.max_running_requests or (256 if device == "cuda" else 32)
    kv = KVManager(slots, max_running + _SPARE_ROWS, max_positions + 1, device, radix=not args.disable_radix_cache,
                   budget=budget, sliding=sliding, window_slots=local)
    eos = eos_token_ids(model_dir, config, tokenizer)
    try:    # the target's K/V buffers, then the draft's (with its drafter)
        pool = KVPool(layers, slots, heads, head_dim, dtype, device, kv.window_pool())
        runner = ModelRunner(target, pool, create_backend(args.attention_backend, device, pool,
                                                          args.enable_deterministic_inference))
        worker = build_worker(args, runner, kv, eos, draft)
    except torch.OutOfMemoryError:
        raise budget.allocation_failed(device_memory(device)[0]) from None

    # Model drafters verify trees of the sizes the draft sizing chooses; n-gram trees vary and run eagerly.
    attach(args, runner, kv, device, max_running, worker.num_draft_tokens if draft is not None else 1,
           worker.capture_hidden)
    scheduler = Scheduler(args, kv, worker, tokenizer, eos, args.context_length, max_running, device,
                          planners or TimedPlanners())
    log.info("model %s: %s%s, %.0f MiB of weights%s; KV pool %d tokens (%.0f MiB)%s", model_dir, dtype,
             f", {quantization} weights" if quantization else "", model_bytes(target) / 2**20,
             f" + {model_bytes(draft) / 2**20:.0f} MiB draft" if draft is not None else "", slots, slots * per_token / 2**20,
             f"; {windowed} of {layers} layers keep a {sliding.window}-token window, in a pool of {local} tokens"
             if sliding else "")
    return EngineParts(args, model_dir, config, tokenizer, kv, runner, draft, scheduler, eos)


class TimedPlanners:
    """The default PlannerFactory: each planner's step cost starts from forwards timed on this machine
    (`timer`: cost_probe.forward_times), the target's and a catching-up draft model's. Each model runner
    is timed once: a new speculative configuration (Engine.set_speculative, which spec tune runs for
    every evaluation) times only a draft model not priced before. Nothing is timed under tensor
    parallelism: every rank would have to run the same forwards, on pools sized apart."""

    def __init__(self, timer=forward_times):
        self._timer = timer
        self._times: WeakKeyDictionary[ModelRunner, dict[int, float]] = WeakKeyDictionary()

    def __call__(self, worker: Worker, args: ServerArgs, kv: KVManager) -> Planner:
        cost = StepCost(PRIOR_ROW_COST[kv.table.device.type])
        if args.tp_size == 1:
            drafter = worker.drafter
            target = self._timed(worker.target, kv, "target")
            if drafter is not None and drafter.catches_up:
                # A drafted step runs `steps` draft forwards of about topk rows a request: the search's
                # depths after the root's, and the feed of what the target accepted.
                cost.measured(target, self._timed(drafter.runner, kv, "draft model"), drafter.steps, drafter.topk)
            else:
                cost.measured(target)
        return Planner(worker, args, cost)

    def _timed(self, runner: ModelRunner, kv: KVManager, what: str) -> dict[int, float]:
        if runner not in self._times:
            times = self._times[runner] = self._timer(runner, kv)
            if times:
                log.info("forward times by rows (for draft sizes), %s: %s", what, _millis(times))
        return self._times[runner]


def _millis(times: dict[int, float]) -> str:
    return ", ".join(f"{r}: {t * 1e3:.1f} ms" for r, t in times.items())


def build_worker(args: ServerArgs, runner: ModelRunner, kv: KVManager, eos_ids, draft: Optional[nn.Module] = None,
                 drafter=None):
    """The worker for `args`: with `drafter` (one already loaded), or a new drafter over `draft`."""
    if drafter is None:
        drafter = create_drafter(args, draft, runner.model, kv.capacity, kv.table.shape[0], kv.table, eos_ids)
    tokens = args.speculative_num_draft_tokens if drafter else 1
    return Worker(runner, kv.table, eos_ids, drafter, tokens, unseeded_rule(args),
                  args.speculative_attention_mode == "decode")
