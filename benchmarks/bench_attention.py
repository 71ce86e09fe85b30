"""CPU attention over the paged KV pool: today's gather + SDPA against ways that copy less.

    python benchmarks/bench_attention.py [--dtypes float32,bfloat16] [--batches 1,8,32,64]
        [--contexts 256,1024,2048] [--modes decode,verify] [--threads 1] [--step]

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head dim 64, 30 layers). Every request has
`context` cached tokens, in contiguous slot runs as the allocator hands out a prefill, and 1 (decode)
or 8 (verify, an EAGLE-style tree mask) new tokens in slots elsewhere. Per case, a whole step's attention (`prepare`, then 30 layers
storing the new K/V and attending, all on one layer's pool) is timed for each candidate, candidates alternated, `--repeats` rounds, medians. Candidates:
- torch: engine/attention/torch_backend.py as the engine runs decode steps: kernels/cpu_attention.c
  over each token's list of visible slots, read in place (batch-invariant: a token's bits do not
  depend on the rest of the batch).
- gather: the backend's other path, used for prefill: each request's K/V gathered into a padded batch
  (two buffers every layer reuses), one SDPA.
- fresh-copy: gather + SDPA with a freshly allocated padded copy per layer (the torch backend before).
- sdpa-only: the same SDPA over K/V gathered beforehand: the bound for keeping gathered K/V between
  steps (which costs a second copy of the cache).
- views: one SDPA per request over views of its contiguous prefix run, no gather (new tokens left
  out): the bound for reading runs in place, and the cost of a Python loop over requests.
With --step, the rest of a decode step (the real SmolLM2-135M forward with attention replaced by a
no-op) is timed too, to give attention's share of a step.
Run it alone: on 2 shared cores, a second busy process skews every number (with more threads than
free cores, torch's parallel regions wait on descheduled threads).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.core.forward_batch import make_batch
from engine.memory.kv_pool import KVPool

H, HKV, D, LAYERS = 9, 3, 64, 30
VERIFY_PARENTS = [-1, 0, 0, 1, 1, 2, 2, 3]      # an 8-node tree: each node sees itself and its ancestors


def tree_mask() -> torch.Tensor:
    n = len(VERIFY_PARENTS)
    m = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        m[i] |= m[VERIFY_PARENTS[i]]
    return m


def make_case(batch: int, context: int, new: int, dtype: torch.dtype, seed: int = 0):
    """A pool holding `batch` requests' contexts in contiguous runs (in shuffled order), their new
    tokens' slots after them, and the ForwardBatch of one decode or verify step."""
    g = torch.Generator().manual_seed(seed)
    size = batch * (context + new)
    pool = KVPool(1, size, HKV, D, dtype)
    pool.k[0][1:size + 1] = torch.randn(size, HKV, D, generator=g).to(dtype)
    pool.v[0][1:size + 1] = torch.randn(size, HKV, D, generator=g).to(dtype)
    table = torch.zeros((batch, context + new), dtype=torch.long)
    for b, run in enumerate(torch.randperm(batch, generator=g).tolist()):
        table[b, :context] = torch.arange(1 + run * context, 1 + (run + 1) * context)
    out_slots = 1 + batch * context + torch.arange(batch * new)
    masks = None if new == 1 else tree_mask().expand(batch, new, new).contiguous()
    fb = make_batch(table, range(batch), [context] * batch, torch.zeros(batch * new, dtype=torch.long), out_slots,
                    [new] * batch, masks=masks)
    fb.decode_step = True
    q = torch.randn(batch * new, H, D, generator=g).to(dtype)
    return pool, fb, q, pool.k[0][out_slots].clone(), pool.v[0][out_slots].clone()


class Gathering(TorchAttentionBackend):
    """The torch backend gathering in every case."""

    def uses_key_lists(self, batch, max_new):
        return False


class FreshCopy(Gathering):
    """The torch backend as it was: each layer gathers into a freshly allocated padded copy."""

    def prepare(self, batch):
        super().prepare(batch)
        batch.attn = dataclasses.replace(batch.attn, buffers=None)


class SdpaOnly(Gathering):
    """The torch backend with the gather done in `prepare`, untimed per layer."""

    def prepare(self, batch):
        super().prepare(batch)
        self.kv = self.kv_pool.gather(0, batch.attn.kv_index)

    def forward(self, q, k, v, layer, batch, scale, **variants):
        pool, self.kv_pool = self.kv_pool, _Gathered(self.kv_pool, self.kv)
        try:
            return super().forward(q, k, v, layer, batch, scale, **variants)
        finally:
            self.kv_pool = pool


class _Gathered:
    """A pool whose gather returns K/V gathered beforehand."""

    def __init__(self, pool: KVPool, kv):
        self.pool, self.kv = pool, kv

    def store(self, *args):
        self.pool.store(*args)

    def gather(self, layer, slots, out=None):
        return self.kv


class Views(AttentionBackend):
    """One SDPA per request over views of its prefix run in the pool (assumed contiguous)."""

    def __init__(self, kv_pool: KVPool):
        self.kv_pool = kv_pool

    def prepare(self, batch):
        starts = batch.table[batch.rows, 0].tolist()
        batch.attn = [(s, p, n) for s, p, n in zip(starts, batch.prefix_lens, batch.extend_lens)]

    def forward(self, q, k, v, layer, batch, scale, **variants):     # SmolLM2's layers have none
        self.kv_pool.store(layer, batch.out_slots, k, v)
        keys, values, out, t = self.kv_pool.k[layer], self.kv_pool.v[layer], [], 0
        for start, prefix, new in batch.attn:
            qs = q[t:t + new].transpose(0, 1)[None]
            ks, vs = (x[start:start + prefix].transpose(0, 1)[None] for x in (keys, values))
            out.append(F.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=True)[0].transpose(0, 1))
            t += new
        return torch.cat(out)


def timed(fn, n: int = 1) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def bench_case(cands: dict, batch: int, context: int, new: int, dtype: torch.dtype, repeats: int) -> dict:
    """{candidate: (ms of a step's attention: prepare, then LAYERS layers; max |diff| from torch)}."""
    pool, fb, q, k, v = make_case(batch, context, new, dtype)
    backends = {name: cls(pool) for name, cls in cands.items()}
    times, out = {n: [] for n in backends}, {}
    for name, be in backends.items():                              # warm-up (and inductor's compile)
        be.prepare(fb)
        out[name] = be.forward(q, k, v, 0, fb, D ** -0.5)

    def step(be):
        be.prepare(fb)
        for _ in range(LAYERS):          # one layer's pool, LAYERS times: as many gathers as a step
            be.forward(q, k, v, 0, fb, D ** -0.5)
    for _ in range(repeats):
        for name, be in backends.items():
            times[name].append(timed(lambda: step(be)))
    ref = out["torch"].float()
    err = {n: (o.float() - ref).abs().max().item() for n, o in out.items() if o.shape == ref.shape and n != "views"}
    return {n: (1e3 * statistics.median(times[n]), err.get(n)) for n in backends}


class _NoAttention(AttentionBackend):
    def prepare(self, batch):
        pass

    def forward(self, q, k, v, layer, batch, scale, **variants):
        return q.contiguous()


def rest_of_step(batches: list[int], news: list[int], dtype: str, repeats: int) -> dict:
    """ms of a SmolLM2-135M forward (and logits of its last tokens) with no attention, per (batch, new)."""
    from engine import Engine

    eng = Engine(model_path="smollm2-135m", dtype=dtype, max_total_tokens=4096, max_running_requests=8)
    model, out = eng.debug.target.model, {}
    for b in batches:
        for n in news:
            fb = make_batch(eng.debug.kv.table, [0] * b, [0] * b, torch.zeros(b * n, dtype=torch.long),
                            torch.zeros(b * n, dtype=torch.long), [n] * b)
            fb.positions = torch.arange(b * n) % n + 100

            def step():
                h, _ = model(fb.input_ids, fb.positions, fb, _NoAttention())
                model.compute_logits(h[:b])
            with torch.inference_mode():
                step()
                out[b, n] = 1e3 * statistics.median(timed(step) for _ in range(repeats))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--contexts", default="256,1024,2048")
    ap.add_argument("--modes", default="decode,verify")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--step", action="store_true", help="also time the rest of a SmolLM2-135M decode step")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cands = {"torch": TorchAttentionBackend, "gather": Gathering, "fresh-copy": FreshCopy, "sdpa-only": SdpaOnly,
             "views": Views}
    ints = lambda s: [int(x) for x in s.split(",")]     # noqa: E731
    modes = {"decode": 1, "verify": len(VERIFY_PARENTS)}
    news = [modes[m] for m in a.modes.split(",")]
    print(f"threads {a.threads}; ms of attention per step ({LAYERS} layers); (err: max |diff| from torch)")
    print("| dtype | mode | batch | context | " + " | ".join(cands) + " | torch share of step | gather / torch |")
    print("|" + " --- |" * (6 + len(cands)))
    for dt in a.dtypes.split(","):
        rest = rest_of_step(ints(a.batches), news, dt, a.repeats) if a.step else {}
        tol = 1e-4 if dt == "float32" else 1e-2                     # bf16: its rounding of the output
        for mode in a.modes.split(","):
            for b in ints(a.batches):
                for ctx in ints(a.contexts):
                    r = bench_case(cands, b, ctx, modes[mode], getattr(torch, dt), a.repeats)
                    cells = " | ".join(f"{t:.1f}" + ("" if e is None or e < tol else f" (err {e:.1e})")
                                       for t, e in r.values())
                    torch_ms = r["torch"][0]
                    share = f"{torch_ms / (torch_ms + rest[b, modes[mode]]):.0%}" if rest else "-"
                    print(f"| {dt} | {mode} | {b} | {ctx} | {cells} | {share} | "
                          f"{r['gather'][0] / torch_ms:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
