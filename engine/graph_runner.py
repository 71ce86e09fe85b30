"""Decode and verify forwards at a few fixed shapes: CUDA graphs on a GPU, compiled graphs on a CPU.

A decode step feeds every running request the same number of tokens (1, or a full draft tree), so its
shape is set by the batch size alone. The batch is padded to the next bucket (1, 2, 4, 8, then steps
of 8, up to the largest size captured) with dummy requests: they read the all-zero padding row of the
request-to-token table and write their K/V to the pool's padding slot, so they touch no real request.
Their outputs are dropped.

- CUDA: the first batch of a bucket is captured into a CUDA graph together with its attention metadata
  (the Triton backend's: its shapes are set by the bucket, not by the context lengths); later batches
  are copied into the captured input tensors and the graph is replayed.
- CPU, with --enable-torch-compile: `fn` is the forward compiled with dynamic shapes, one graph for
  every batch size (sizes 0 and 1 aside) and context length, so no padding is needed (buckets of one).
The tests run the padding and a stand-in for capture and replay on the CPU.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional

import torch

from engine.forward_batch import ForwardBatch

log = logging.getLogger(__name__)


def buckets(max_bs: int, pad: bool = True) -> list[int]:
    if not pad:
        return list(range(1, max_bs + 1))
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, max_bs, 8))
    return sizes + [max_bs]


def pad_batch(batch: ForwardBatch, size: int, pad_row: int, pad_slot: int) -> ForwardBatch:
    """`batch` with dummy requests appended up to `size` requests, each like the real ones (same new
    tokens and extra keys), reading the padding row and writing the padding slot."""
    extra = size - batch.batch_size
    if extra == 0:
        return batch
    n, e = batch.extend_lens[0], (batch.extra_lens or [0])[0]
    device = batch.input_ids.device

    def cat(t: torch.Tensor, count: int, value: int) -> torch.Tensor:
        return torch.cat([t, torch.full((count,), value, dtype=t.dtype, device=device)])

    masks = batch.masks
    if masks is not None:
        masks = torch.cat([masks, torch.ones((extra, *masks.shape[1:]), dtype=torch.bool, device=masks.device)])
    return dataclasses.replace(
        batch, input_ids=cat(batch.input_ids, extra * n, 0), positions=cat(batch.positions, extra * n, 0),
        out_slots=cat(batch.out_slots, extra * n, pad_slot), rows=cat(batch.rows, extra, pad_row),
        prefix_lens=batch.prefix_lens + [0] * extra, extend_lens=batch.extend_lens + [n] * extra,
        extra_slots=None if batch.extra_slots is None else cat(batch.extra_slots, extra * e, pad_slot),
        extra_lens=None if batch.extra_lens is None else batch.extra_lens + [e] * extra, masks=masks, attn=None)


def cuda_capture(fn: Callable, batch: ForwardBatch):
    """Capture fn(batch) into a CUDA graph: (replay, the outputs replay writes)."""
    fn(batch)                                        # warm-up: kernels compiled, memory sized
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(batch)
    graph.replay()          # capturing records the kernels without running them: this batch's results
    return graph.replay, out


class StepGraphs:
    """Runs `fn(batch)` (a model forward returning (hidden, captured)) at bucketed batch sizes; with
    `capture` (cuda_capture on a GPU), each shape is captured once and replayed on its static inputs."""

    def __init__(self, fn: Callable, prepare: Callable[[ForwardBatch], None], max_bs: int, pad_row: int,
                 pad_slot: int, capture: Optional[Callable] = None, pad: bool = True):
        self.fn, self.prepare, self.capture = fn, prepare, capture
        self.sizes = buckets(max_bs, pad)
        self.pad_row, self.pad_slot = pad_row, pad_slot
        self._graphs: dict[tuple, tuple] = {}     # shape key -> (replay, static batch, outputs)

    def bucket(self, batch: ForwardBatch) -> Optional[int]:
        """The bucket for a decode-shaped batch (every request the same new tokens and extra keys,
        nothing cached per request beyond its row), or None to run it as it is."""
        n, e = batch.extend_lens[0], (batch.extra_lens or [0])[0]
        uniform = all(k == n for k in batch.extend_lens) and all(k == e for k in (batch.extra_lens or [0]))
        if not uniform or batch.batch_size > self.sizes[-1]:
            return None
        return next(s for s in self.sizes if s >= batch.batch_size)

    def run(self, batch: ForwardBatch, size: int) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Hidden states (and captured ones) of the batch's real tokens, computed at bucket `size`."""
        padded = pad_batch(batch, size, self.pad_row, self.pad_slot)
        self.prepare(padded)
        hidden, captured = self._replay(padded) if self.capture else self.fn(padded)
        real = len(batch.input_ids)
        return hidden[:real], {i: h[:real] for i, h in captured.items()}

    def _replay(self, batch: ForwardBatch):
        key = (batch.batch_size, batch.extend_lens[0], (batch.extra_lens or [0])[0], batch.masks is not None,
               batch.capture_hidden)
        if key not in self._graphs:
            log.info("capturing a graph for %d requests x %d tokens", batch.batch_size, batch.extend_lens[0])
            # The graph reads these tensors by address at every replay: its own copy of the batch keeps
            # them alive when the caller prepares its batch again (a new attn frees the old metadata).
            static = dataclasses.replace(batch)
            replay, out = self.capture(self.fn, static)
            self._graphs[key] = (replay, static, out)
            return out
        replay, static, out = self._graphs[key]
        _copy_into(static, batch)
        replay()
        return out


def _copy_into(static: ForwardBatch, batch: ForwardBatch) -> None:
    """Copy a batch's tensors (its attention metadata's too) into the captured ones of the same shapes."""
    for name in ("input_ids", "positions", "out_slots", "rows", "extra_slots", "masks"):
        src = getattr(batch, name)
        if src is not None:
            getattr(static, name).copy_(src)
    for field in dataclasses.fields(static.attn):
        dst, src = getattr(static.attn, field.name), getattr(batch.attn, field.name)
        if isinstance(dst, torch.Tensor):
            dst.copy_(src)
        else:
            assert dst == src, f"captured {field.name}={dst!r}, batch has {src!r}: not one shape"


def attach(args, runner, kv, device: str, max_running: int, draft_tokens: int, tree_masks: bool) -> None:
    """Give the target's runner its StepGraphs when the flags and the hardware allow, and warm every
    bucket up (compiling or capturing it) with dummy requests before the first real one. Flags that
    cannot act here say so in one line."""
    cuda = device.startswith("cuda")
    if not cuda and (args.cuda_graph_max_bs is not None or args.disable_cuda_graph):
        log.info("--cuda-graph-max-bs / --disable-cuda-graph have no effect on the CPU (no CUDA graphs here)")
    graphs_on_gpu = cuda and not args.disable_cuda_graph
    if graphs_on_gpu and type(runner.backend).__name__ != "TritonAttentionBackend":
        log.info("CUDA graphs need --attention-backend triton (its metadata has the bucket's shape); decoding "
                 "runs without them")
        graphs_on_gpu = False
    if not (graphs_on_gpu or args.enable_torch_compile):
        return
    fn = _compiled(runner, cuda) if args.enable_torch_compile else runner.run_model
    max_bs = (args.cuda_graph_max_bs or min(max_running, 160)) if graphs_on_gpu else args.torch_compile_max_bs
    runner.graphs = StepGraphs(fn, runner.backend.prepare, min(max_bs, max_running), kv.pad_row, kv.pad_slot,
                               cuda_capture if graphs_on_gpu else None, pad=graphs_on_gpu)
    shapes = [(1, None)] + ([(draft_tokens, tree_masks)] if draft_tokens > 1 else [])
    # Every bucket is captured; a dynamic compile needs batch sizes 1 and 2 (1 is specialised).
    sizes = runner.graphs.sizes if graphs_on_gpu else runner.graphs.sizes[:2]
    what = "capturing CUDA graphs" if graphs_on_gpu else "compiling (torch.compile)"
    runs = [(size, n, masks) for n, masks in shapes for size in sizes]
    for i, (size, n, masks) in enumerate(runs, 1):
        log.info("%s for decode steps: %d of %d (%d requests x %d tokens)", what, i, len(runs), size, n)
        # As in a real step: slots from the allocator (outside inference mode), the rest made inside.
        slots = torch.full((size * n,), kv.pad_slot, dtype=torch.long)
        with torch.inference_mode():
            runner.graphs.run(_dummy_batch(kv, size, n, masks, slots), size)


def _dummy_batch(kv, size: int, n: int, masks: Optional[bool], slots: torch.Tensor) -> ForwardBatch:
    """`size` requests of n tokens on the padding row and slot: a batch of nothing but padding. Its
    cached prefix (the padding row's zero slots) is a few tokens long, as a real one is: a length of 1
    would be compiled as a special case."""
    from engine.forward_batch import make_batch

    device = kv.table.device
    tree = torch.ones((size, n, n), dtype=torch.bool, device=device).tril() if masks else None
    return make_batch(kv.table, [kv.pad_row] * size, [8] * size, torch.zeros(size * n, dtype=torch.long), slots,
                      [n] * size, masks=tree)


def _compiled(runner, cuda: bool) -> Callable:
    """The runner's model forward through torch.compile (inductor). On a CPU with freezing: weights
    become constants, so inductor can pack them for its own GEMM kernels. Compiled code is cached on
    disk (TORCHINDUCTOR_CACHE_DIR, by default under ~/.cache/spec), so a second start is faster."""
    import os

    import torch._dynamo
    import torch._inductor.config

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.expanduser("~/.cache/spec/inductor"))
    torch._inductor.config.fx_graph_cache = True
    torch._inductor.config.freezing = not cuda
    # A graph per bucket and batch kind, and context lengths that vary: more than dynamo's default 8.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    model = torch.compile(runner.model, dynamic=not cuda)
    return lambda batch: model(batch.input_ids, batch.positions, batch, runner.backend)
