"""Decode and verify forwards at a few fixed shapes: CUDA graphs on a GPU, compiled graphs on a CPU.

A decode step feeds every running request the same number of tokens (1, or a tree of one size), so its
shape is set by the batch size and the tree's. The batch is padded to the next bucket (1, 2, 4, 8, then
steps of 8, up to the largest size captured) with dummy requests: they read the all-zero padding row of
the request-to-token table and write their K/V to the pool's padding slot, so they touch no real request.
Their outputs are dropped.

- CUDA: every shape a step can take (step_shapes, at every bucket) is captured at start-up into a CUDA
  graph together with its attention metadata (the Triton backend's: its shapes are set by the bucket,
  not by the context lengths); a batch is copied into the captured input tensors and the graph replayed.
  Nothing is captured while serving: a step of another shape (requests drafting different tree sizes,
  Predicted Output chains) runs eagerly.
- CPU, with --enable-torch-compile: `fn` is the forward compiled with dynamic shapes, one graph for
  every batch size (sizes 0 and 1 aside) and context length, so no padding is needed (buckets of one).
The tests run the padding and a stand-in for capture and replay on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from typing import Callable, Optional

import torch

from engine.core.forward_batch import ForwardBatch
from engine.progress import progress

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


def step_shapes(draft_tokens: int, topk: int, sized: bool, nodes_as_rows: bool) -> list[tuple[int, bool]]:
    """(tokens a request, tree masks) of every uniform decode step a worker sends: plain steps, and the
    verification of trees of `draft_tokens` nodes (1: no model drafter). Sized drafts
    (--speculative-adaptive) verify every size from one draft token to the whole tree. The search's trees
    carry masks whenever topk > 1 (draft_tree_search.py), whatever shape they came out. Trees verified as
    decode rows (--speculative-attention-mode decode) make rows of ragged extra keys, never one of these."""
    if draft_tokens <= 1 or nodes_as_rows:
        return [(1, False)]
    return [(1, False)] + [(n, topk > 1) for n in (range(2, draft_tokens + 1) if sized else [draft_tokens])]


class CudaGraph:
    """fn(batch) captured into a CUDA graph; calling it with a batch of the same shape copies the batch
    into the captured inputs, replays and returns the captured outputs. Graphs share one memory `pool`:
    they replay one at a time, so their intermediates can overlap."""

    def __init__(self, fn: Callable, batch: ForwardBatch, pool=None):
        # The graph reads these tensors by address at every replay: its own copy of the batch keeps
        # them alive when the caller prepares its batch again (a new attn frees the old metadata).
        self.fn, self.static = fn, dataclasses.replace(batch)
        self.out = self._capture(pool)

    def _capture(self, pool):
        self.fn(self.static)                                 # warm-up: kernels compiled, memory sized
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            return self.fn(self.static)

    def _replay(self) -> None:
        self.graph.replay()

    def __call__(self, batch: ForwardBatch):
        _copy_into(self.static, batch)
        self._replay()
        return self.out


class StepGraphs:
    """Runs `fn(batch)` (a model forward returning (hidden, captured)) at bucketed batch sizes. With
    `capture` (a CudaGraph maker on a GPU), each shape is captured once and replayed on its static
    inputs; once sealed (start-up's captures done), a shape not captured runs eagerly instead."""

    def __init__(self, fn: Callable, prepare: Callable[[ForwardBatch], None], max_bs: int, pad_row: int,
                 pad_slot: int, capture: Optional[Callable] = None, pad: bool = True):
        self.fn, self.prepare, self.capture = fn, prepare, capture
        self.sizes = buckets(max_bs, pad)
        self.pad_row, self.pad_slot = pad_row, pad_slot
        self._graphs: dict[tuple, Callable] = {}     # shape key -> the captured graph
        self.sealed = False

    def bucket(self, batch: ForwardBatch) -> Optional[int]:
        """The bucket for a decode-shaped batch (every request the same new tokens and extra keys,
        nothing cached per request beyond its row), or None to run it as it is."""
        n, e = batch.extend_lens[0], (batch.extra_lens or [0])[0]
        uniform = all(k == n for k in batch.extend_lens) and all(k == e for k in (batch.extra_lens or [0]))
        if not uniform or batch.batch_size > self.sizes[-1]:
            return None
        size = next(s for s in self.sizes if s >= batch.batch_size)
        if self.capture and self.sealed and _key(batch, size) not in self._graphs:
            log.debug("no graph captured for %d requests x %d tokens (masks %s, hidden %s): runs eagerly", size, n,
                      batch.masks is not None, batch.capture_hidden)
            return None
        return size

    def run(self, batch: ForwardBatch, size: int) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Hidden states (and captured ones) of the batch's real tokens, computed at bucket `size`."""
        padded = pad_batch(batch, size, self.pad_row, self.pad_slot)
        self.prepare(padded)
        hidden, captured = self._replay(padded) if self.capture else self.fn(padded)
        real = len(batch.input_ids)
        return hidden[:real], {i: h[:real] for i, h in captured.items()}

    def _replay(self, batch: ForwardBatch):
        key = _key(batch, batch.batch_size)
        if key not in self._graphs:
            if self.sealed:
                raise RuntimeError(f"no graph captured for the shape {key}: StepGraphs.bucket runs it eagerly")
            log.debug("capturing a graph for %d requests x %d tokens", batch.batch_size, batch.extend_lens[0])
            self._graphs[key] = self.capture(self.fn, batch)
        return self._graphs[key](batch)


def _key(batch: ForwardBatch, size: int) -> tuple:
    """What sets a captured graph's shapes: requests, tokens and extra keys a request, masks, captured states."""
    return (size, batch.extend_lens[0], (batch.extra_lens or [0])[0], batch.masks is not None, batch.capture_hidden)


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


def attach(args, runner, kv, device: str, max_running: int, draft_tokens: int,
           capture_hidden: tuple[int, ...] = ()) -> None:
    """Give the target's runner its StepGraphs when the flags and the hardware allow, and capture (or
    compile) every step shape before the first real request (capture_shapes). Flags that cannot act
    here say so in one line."""
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
    capture = functools.partial(CudaGraph, pool=torch.cuda.graph_pool_handle()) if graphs_on_gpu else None
    runner.graphs = StepGraphs(fn, runner.backend.prepare, min(max_bs, max_running), kv.pad_row, kv.pad_slot,
                               capture, pad=graphs_on_gpu)
    capture_shapes(args, runner, kv, draft_tokens, capture_hidden)


def capture_shapes(args, runner, kv, draft_tokens: int, capture_hidden: tuple[int, ...] = ()) -> None:
    """Capture every decode step shape of a worker (`draft_tokens`: the tree a model drafter verifies, 1
    for none; `capture_hidden`: the hidden states its steps return) at every bucket of the runner's
    graphs, those captured already kept, then seal them; compiled graphs are warmed up instead. A new
    speculative configuration (Engine.set_speculative) calls it again. Nothing without graphs."""
    graphs = runner.graphs
    if graphs is None:
        return
    shapes = step_shapes(draft_tokens, args.speculative_eagle_topk or 1, args.speculative_adaptive == "on",
                         args.speculative_attention_mode == "decode")
    if graphs.capture is None:
        # A dynamic compile needs batch sizes 1 and 2 (1 is specialised).
        warm_up(graphs, kv, _compiled_shapes(shapes), graphs.sizes[:2], capture_hidden, "compiling (torch.compile)")
        return
    graphs.sealed = False
    warm_up(graphs, kv, shapes, graphs.sizes, capture_hidden, "capturing CUDA graphs")
    graphs.sealed = True


def _compiled_shapes(shapes: list[tuple[int, bool]]) -> list[tuple[int, bool]]:
    """The shapes a dynamic compile tells apart: one token a request (specialised), and trees with
    masks and without (the largest of each)."""
    largest = {masks: (n, masks) for n, masks in sorted(shapes) if n > 1}
    return [(1, False), *largest.values()]


def warm_up(graphs: StepGraphs, kv, shapes: list[tuple[int, bool]], sizes: list[int],
            capture_hidden: tuple[int, ...], what: str) -> None:
    """Run every (size, shape) once on dummy requests, the largest first: graphs sharing a memory pool
    then fit in what the largest sized."""
    runs = sorted(((size, n, masks) for n, masks in shapes for size in sizes), key=lambda r: -r[0] * r[1])
    log.info("%s for decode steps: %d (batch sizes %s; tokens a request %s)", what, len(runs),
             ", ".join(map(str, sizes)), ", ".join(f"{n}{' tree' if masks else ''}" for n, masks in shapes))
    start = time.perf_counter()
    for size, n, masks in progress(runs, what, len(runs)):
        log.debug("%s: %d requests x %d tokens%s", what, size, n, " (tree masks)" if masks else "")
        # As in a real step: slots from the allocator (outside inference mode), the rest made inside.
        slots = torch.full((size * n,), kv.pad_slot, dtype=torch.long)
        with torch.inference_mode():
            graphs.run(_dummy_batch(kv, size, n, masks, slots, capture_hidden), size)
    log.info("%s: done in %.1f s", what, time.perf_counter() - start)


def _dummy_batch(kv, size: int, n: int, masks: Optional[bool], slots: torch.Tensor,
                 capture_hidden: tuple[int, ...] = ()) -> ForwardBatch:
    """`size` requests of n tokens on the padding row and slot: a batch of nothing but padding. Its
    cached prefix (the padding row's zero slots) is a few tokens long, as a real one is: a length of 1
    would be compiled as a special case."""
    from engine.core.forward_batch import make_batch

    device = kv.table.device
    tree = torch.ones((size, n, n), dtype=torch.bool, device=device).tril() if masks else None
    return make_batch(kv.table, [kv.pad_row] * size, [8] * size, torch.zeros(size * n, dtype=torch.long), slots,
                      [n] * size, masks=tree, capture_hidden=capture_hidden)


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
    forward = torch.compile(_own_forward(runner.model), dynamic=not cuda)
    return lambda batch: forward(batch.input_ids, batch.positions, batch, runner.backend)


_compiled_forwards = itertools.count()


def _own_forward(model) -> Callable:
    """The model's forward on a code object of its own, named apart. Dynamo keeps its graphs per code
    object and what it learnt of the shapes (which to make dynamic) per code name: two engines compiling
    one model class would share both, the second compiled as a recompile of the first (other shapes
    specialised, other kernels, other rounding in bf16), so an engine's tokens would depend on what else
    was compiled in the process."""
    import types

    fn = type(model).forward
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_compiled_forwards)}")
    own = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return own.__get__(model)
