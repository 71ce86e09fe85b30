"""The GPU check's measuring stages (benchmarks/gpu_check.py runs each in a process of its own, under its
own time limit). A stage fills a dict that is written to stage-NAME.json after every measurement, so a
stage cut short keeps what it finished; an exception is recorded there as its `error`.

The target is a Llama-3.1-8B-shaped model with random weights made on the device (TINY in the dry run),
loaded through the engine's own loader from no file; EAGLE-3 heads the same way. Random weights accept
no draft: speculation's cost is measured with whole trees (adaptive sizing off), and acceptance is
controlled by feeding the model's own greedy output back as a Predicted Output.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator, Optional

from gpu_model import LLAMA_8B, TINY, checkpoint_makers, random_checkpoints, write_model_dirs

ROOT = Path(__file__).resolve().parents[1]
# EAGLE-3 heads published for Llama-3.1-8B keep 32k draft tokens.
EAGLE3_DRAFT_VOCAB = {"gpu": 32000, "cpu": 200}
# The seed's trees: (steps, topk, draft tokens).
TREES = {"chain": (3, 1, 4), "tree": (5, 4, 8)}
# Kernel kinds of the profile, by kernel name (the first that matches).
KINDS = (("attention", r"attention|attn|flash|sdpa|paged"), ("norm", r"norm|rms"),
         ("gemm", r"gemm|gemv|matmul|\bmm\b|addmm|cutlass|cublas|xmma|nvjet|linear|splitk"),
         ("copy", r"copy|memcpy|memset|index_put|scatter|gather|cat|fill"),
         ("elementwise", r"elementwise|vectorized|unrolled|silu|mul|add|exp|neg|pow|rsqrt|reduce|sum|where"))


def plan(dry: bool) -> dict:
    """Shapes and sizes of every stage: tiny ones for the dry run on the CPU."""
    if dry:
        return {"config": TINY, "dtype": "float32", "batches": [1, 2], "spec_batches": [1, 2], "rows": [1, 2, 4],
                "new_tokens": 8, "spec_new_tokens": 8, "eager_new_tokens": 8, "prompt_len": 8, "context": 32,
                "iters": 2, "draft_vocab": EAGLE3_DRAFT_VOCAB["cpu"], "hbm_bytes": 2**24, "profile_steps": 4,
                "controlled_tokens": 16, "rates": [2, 4, 8], "chain_cap": 8, "max_bs": 4}
    return {"config": LLAMA_8B, "dtype": "bfloat16", "batches": [1, 16], "spec_batches": [1, 4, 16],
            "rows": [1, 2, 4, 8, 16, 32, 64], "new_tokens": 128, "spec_new_tokens": 64, "eager_new_tokens": 24,
            "prompt_len": 32, "context": 512, "iters": 20, "draft_vocab": EAGLE3_DRAFT_VOCAB["gpu"],
            "hbm_bytes": 2**31, "profile_steps": 20, "controlled_tokens": 128, "rates": [2, 4, 8], "chain_cap": 8,
            "max_bs": 64}


class Context:
    """What every stage reads: the plan, the device, the model directories."""

    def __init__(self, dry: bool, root: Path):
        import torch

        self.plan, self.dry = plan(dry), dry
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.dtype = getattr(torch, self.plan["dtype"])
        self.target, self.draft = write_model_dirs(root, self.plan["config"], self.plan["draft_vocab"])
        self.root = root

    def weights(self):
        """The random checkpoints, loaded by the engine from no file while this is entered."""
        return random_checkpoints(checkpoint_makers(self.target, self.draft, self.plan["config"],
                                                    self.plan["draft_vocab"], self.dtype, self.device))

    def engine(self, max_bs: int, **flags):
        """An engine on the random target with the default flags, but for `flags`."""
        from engine import Engine

        return Engine(model_path=str(self.target), dtype=self.plan["dtype"], max_running_requests=max_bs,
                      cuda_graph_max_bs=max_bs, max_total_tokens=max(16384, max_bs * 1024), context_length=2048,
                      grammar_backend="none", disable_radix_cache=True, **flags)


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def prompts(batch: int, prompt_len: int) -> list[list[int]]:
    return [[3 + (b * 7 + i) % 300 for i in range(prompt_len)] for b in range(batch)]


def timed_generate(eng, ids: list[list[int]], params: dict, device: str) -> tuple[float, list[dict]]:
    sync(device)
    start = time.perf_counter()
    outs = eng.generate(input_ids=ids, sampling_params=params)
    sync(device)
    return time.perf_counter() - start, outs


def greedy(new_tokens: int, **extra) -> dict:
    return {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True, **extra}


def decode_speed(eng, batch: int, new_tokens: int, prompt_len: int, device: str) -> dict:
    """Decode tokens/s of `batch` requests: generating new_tokens less generating one (the prefill and
    the first token), so prefill does not count; a step's milliseconds (speculative steps counted)."""
    ids = prompts(batch, prompt_len)
    timed_generate(eng, ids, greedy(4), device)                                # warm-up: kernels compiled
    t_one, _ = timed_generate(eng, ids, greedy(1), device)
    t_all, outs = timed_generate(eng, ids, greedy(new_tokens), device)
    steps = max(1, max(o["meta_info"].get("spec_verify_ct", 0) for o in outs)) if eng.args.speculative_algorithm \
        else new_tokens - 1
    decode_s = max(t_all - t_one, 1e-9)
    return {"decode_tok_s": round(batch * (new_tokens - 1) / decode_s, 1),
            "ms_per_step": round(decode_s / steps * 1e3, 3), "steps": steps}


def forward_ms(eng, batch: int, tokens: int, context: int, iters: int, device: str) -> float:
    """Milliseconds of one target forward of `batch` requests x `tokens` new tokens after `context` cached
    positions, logits for every token, as a decode step runs it (replayed from a CUDA graph where one is
    captured). The requests sit on the KV manager's padding row and slot, as graph warm-up's do."""
    import torch

    from engine.core.forward_batch import make_batch

    kv, runner = eng.debug.kv, eng.debug.target
    slots = torch.full((batch * tokens,), kv.pad_slot, dtype=torch.long)       # made outside inference mode
    with torch.inference_mode():
        step = make_batch(kv.table, [kv.pad_row] * batch, [context] * batch,
                          torch.zeros(batch * tokens, dtype=torch.long), slots, [tokens] * batch)
        for _ in range(3):
            runner.forward(step, all_logits=True, decode=True)
        sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            runner.forward(step, all_logits=True, decode=True)
        sync(device)
    return (time.perf_counter() - start) / iters * 1e3


# ------------------------------------------------------------------------------------------------ stages
def stage_hbm(ctx: Context, result: dict, save: Callable) -> None:
    """Device-to-device copy bandwidth (bytes read + written over the time), the best of five: the
    floor a step that reads its weights once can reach."""
    import torch

    n = ctx.plan["hbm_bytes"]
    src = torch.empty(n, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        sync(ctx.device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(ctx.device)
        best = min(best, time.perf_counter() - start)
    result.update(bytes=n, best_s=best, copy_gb_s=round(2 * n / best / 1e9, 1),
                  note="a CPU copy: measures nothing on the GPU" if ctx.device == "cpu" else "device-to-device copy")


VARIANTS = {"default": {}, "triton+graphs": {"attention_backend": "triton"},
            "torch eager": {"attention_backend": "torch", "disable_cuda_graph": True},
            "torch.compile+graphs": {"attention_backend": "triton", "enable_torch_compile": True}}


def stage_plain(ctx: Context, result: dict, save: Callable) -> None:
    """Plain decoding at each batch with the default flags, then each alternative: one that resolves to
    the default's configuration is not run again; one that fails records its error and the rest go on."""
    p = ctx.plan
    result.update(rows=[], variants={})
    default_backend = None
    for variant, flags in VARIANTS.items():
        if variant != "default" and flags.get("attention_backend") == "triton" and ctx.device == "cpu":
            result["variants"][variant] = "skipped on cpu (Triton's interpreter or compiling: minutes)"
            continue
        if variant == "triton+graphs" and default_backend == "triton" and ctx.device == "cuda":
            result["variants"][variant] = "same as default (auto resolved to triton + CUDA graphs)"
            continue
        try:
            eng = ctx.engine(max(p["batches"]), **flags)
        except Exception as e:      # noqa: BLE001 - a variant that cannot start is recorded, not fatal
            result["variants"][variant] = f"error: {type(e).__name__}: {e}"
            save()
            continue
        result["weight_bytes"] = eng.debug.target.model.weight_bytes
        if variant == "default":
            default_backend = eng.args.attention_backend
            result["default_resolved"] = {"attention_backend": default_backend,
                                          "cuda_graphs": eng.debug.target.graphs is not None}
        new_tokens = p["eager_new_tokens"] if "eager" in variant else p["new_tokens"]
        for batch in p["batches"]:
            row = {"variant": variant, "batch": batch,
                   **decode_speed(eng, batch, new_tokens, p["prompt_len"], ctx.device)}
            result["rows"].append(row)
            print(row, flush=True)
            save()
        result["variants"][variant] = "ok"
        close(eng, ctx.device)


def close(eng, device: str) -> None:
    import torch

    eng.shutdown()
    del eng
    if device == "cuda":
        torch.cuda.empty_cache()


def stage_profile(ctx: Context, result: dict, save: Callable) -> None:
    """Graphed decode steps at batch 1 under torch.profiler: kernels a step, their time by kind and the
    host's gaps between them. The steps' share is a run of N + 1 tokens less a run of one (the same
    prefill), over N."""
    p = ctx.plan
    eng = ctx.engine(1)
    ids, n = prompts(1, p["prompt_len"]), p["profile_steps"]
    timed_generate(eng, ids, greedy(4), ctx.device)                    # warm-up
    one, many = (profile_run(eng, ids, k, ctx.device) for k in (1, n + 1))
    result.update(steps=n, kernels_per_step=round((many["kernels"] - one["kernels"]) / n, 1),
                  kernel_ms_per_step={kind: round((many["by_kind"].get(kind, 0) - one["by_kind"].get(kind, 0)) / n, 4)
                                      for kind in [k for k, _ in KINDS] + ["other"]},
                  gap_ms_per_step=round((many["gaps_ms"] - one["gaps_ms"]) / n, 4),
                  wall_ms_per_step=round((many["wall_ms"] - one["wall_ms"]) / n, 4),
                  events="CUDA kernels and copies" if ctx.device == "cuda" else "top-level CPU ops (the dry run)")
    close(eng, ctx.device)


def profile_run(eng, ids, new_tokens: int, device: str) -> dict:
    """Kernels of one generate call: count, milliseconds by kind, host gaps between consecutive ones."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        eng.generate(input_ids=ids, sampling_params=greedy(new_tokens))
        sync(device)
    wall = time.perf_counter() - start
    kernels = sorted(kernel_events(prof.events(), device), key=lambda e: e.time_range.start)
    by_kind: dict[str, float] = {}
    for e in kernels:
        kind = kernel_kind(e.name)
        by_kind[kind] = by_kind.get(kind, 0.0) + (e.time_range.end - e.time_range.start) / 1e3
    gaps = sum(max(0, b.time_range.start - a.time_range.end) for a, b in zip(kernels, kernels[1:])) / 1e3
    return {"kernels": len(kernels), "by_kind": by_kind, "gaps_ms": gaps, "wall_ms": wall * 1e3}


def kernel_events(events, device: str) -> list:
    from torch.autograd import DeviceType

    if device == "cuda":
        return [e for e in events if e.device_type == DeviceType.CUDA]
    return [e for e in events if e.name.startswith("aten::") and e.cpu_parent is None]


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, lowered)), "other")


def stage_speculation(ctx: Context, result: dict, save: Callable) -> None:
    """Speculation's cost with random drafts: the forward's time against rows, the plain step, and the
    full drafted EAGLE-3 step (whole trees every step: --speculative-adaptive off; graphs captured before
    timing) at each batch, split into drafting (the draft and its catch-up, timed apart with the device
    synchronised around them) and the rest (the verify forward and acceptance)."""
    from engine.core.graph_runner import capture_shapes

    p = ctx.plan
    eng = ctx.engine(p["max_bs"])
    result["forward_ms_by_rows"] = {r: round(forward_ms(eng, r, 1, p["context"], p["iters"], ctx.device), 3)
                                    for r in p["rows"]}
    save()
    plain = {b: decode_speed(eng, b, p["spec_new_tokens"], p["prompt_len"], ctx.device) for b in p["spec_batches"]}
    result["plain"] = plain
    save()
    result["trees"] = {}
    for name, (steps, topk, tokens) in TREES.items():
        eng.set_speculative(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(ctx.draft),
                            speculative_num_steps=steps, speculative_eagle_topk=topk,
                            speculative_num_draft_tokens=tokens, speculative_adaptive="off")
        worker = eng.debug.worker
        capture_shapes(eng.args, eng.debug.target, eng.debug.kv, worker.num_draft_tokens, worker.capture_hidden)
        entry = result["trees"][f"{steps},{topk},{tokens}"] = {"kind": name, "batches": {}}
        for b in p["spec_batches"]:
            full = decode_speed(eng, b, p["spec_new_tokens"], p["prompt_len"], ctx.device)
            drafting = drafting_ms(eng, b, p, ctx.device)
            entry["batches"][b] = {**full, "drafting_ms_per_step": drafting,
                                   "rest_ms_per_step": round(full["ms_per_step"] - drafting, 3),
                                   "step_ratio": round(full["ms_per_step"] / plain[b]["ms_per_step"], 3)}
            print(name, b, entry["batches"][b], flush=True)
            save()
    close(eng, ctx.device)


def drafting_ms(eng, batch: int, p: dict, device: str) -> float:
    """Milliseconds a step spends drafting: the drafter's draft and after_verify, each with the device
    synchronised before and after (a run of its own: the synchronisation slows the step)."""
    drafter, spent = eng.debug.drafter, []

    def timed(method):
        def run(*args, **kwargs):
            sync(device)
            start = time.perf_counter()
            out = method(*args, **kwargs)
            sync(device)
            spent.append(time.perf_counter() - start)
            return out
        return run

    drafter.draft, drafter.after_verify = timed(drafter.draft), timed(drafter.after_verify)
    try:
        _, outs = timed_generate(eng, prompts(batch, p["prompt_len"]), greedy(p["spec_new_tokens"]), device)
    finally:
        del drafter.draft, drafter.after_verify
    steps = max(1, max(o["meta_info"].get("spec_verify_ct", 0) for o in outs))
    return round(sum(spent) / steps * 1e3, 3)


def stage_controlled(ctx: Context, result: dict, save: Callable) -> None:
    """Known acceptance: the model's own greedy output fed back as a Predicted Output (token ids),
    intact and with every k-th token changed; tok/s against plain decoding at batch 1. Chains are capped
    (prediction.MAX_CHAIN) and every chain shape is captured before timing. The intact prediction with
    chains of 3 is every draft of a (3, 1, 4) chain accepted: it stands for EAGLE-3 at full acceptance,
    without the draft model's cost."""
    import engine.speculative.prediction as prediction
    from engine.core.graph_runner import capture_shapes

    p = ctx.plan
    eng = ctx.engine(1)
    worker = eng.debug.worker
    capture_shapes(eng.args, eng.debug.target, eng.debug.kv, p["chain_cap"] + 1, worker.capture_hidden)
    ids, n = prompts(1, p["prompt_len"]), p["controlled_tokens"]
    _, outs = timed_generate(eng, ids, greedy(n), ctx.device)              # also the warm-up
    output = outs[0]["output_ids"]
    plain = tok_s(eng, ids, greedy(n), n, ctx.device)
    result.update(tokens=n, plain_tok_s=plain, chain_cap=p["chain_cap"], rates={})
    save()
    prediction.MAX_CHAIN = p["chain_cap"]
    for k in [None] + p["rates"]:
        predicted = changed_every(output, k, ctx.plan["config"]["vocab_size"])
        speed = tok_s(eng, ids, greedy(n, prediction=predicted), n, ctx.device)
        result["rates"]["intact" if k is None else f"every {k}th changed"] = {
            "tok_s": speed, "speedup": round(speed / plain, 3)}
        save()
    prediction.MAX_CHAIN = 3
    speed = tok_s(eng, ids, greedy(n, prediction=output), n, ctx.device)
    result["all_accepted_chain_3"] = {"tok_s": speed, "speedup": round(speed / plain, 3),
                                      "label": "Predicted Output, chains of 3, all accepted: a (3, 1, 4) chain at "
                                               "full acceptance without the draft model's cost"}
    close(eng, ctx.device)


def tok_s(eng, ids, params: dict, n: int, device: str) -> float:
    """Decode tokens/s of one request: n tokens less one (prefill and the first token), best of two."""
    one, _ = timed_generate(eng, ids, {**params, "max_new_tokens": 1}, device)
    best = min(timed_generate(eng, ids, params, device)[0] for _ in range(2))
    return round((n - 1) / max(best - one, 1e-9), 1)


def changed_every(tokens: list[int], k: Optional[int], vocab: int) -> list[int]:
    """`tokens` with every k-th one (1-based) replaced by another id clear of the special tokens."""
    if k is None:
        return list(tokens)
    return [3 + (t - 2) % (vocab - 3) if (i + 1) % k == 0 else t for i, t in enumerate(tokens)]


def stage_fp8(ctx: Context, result: dict, save: Callable) -> None:
    """Plain decoding at batch 1 with --quantization fp8; "not available" where the engine refuses it."""
    from engine.errors import ConfigError

    p = ctx.plan
    try:
        eng = ctx.engine(1, quantization="fp8")
    except ConfigError as e:
        result.update(available=False, note=f"not available: {e}")
        return
    result.update(available=True, weight_bytes=eng.debug.target.model.weight_bytes,
                  **decode_speed(eng, 1, p["new_tokens"], p["prompt_len"], ctx.device))
    close(eng, ctx.device)


# Qwen3-30B-A3B's mixture layer: 128 experts, 8 a token, hidden 2048, expert width 768.
MOE_SHAPES = {"gpu": dict(experts=128, top_k=8, hidden=2048, inter=768, tokens=[1, 8, 64]),
              "cpu": dict(experts=8, top_k=2, hidden=64, inter=48, tokens=[1, 4])}


def stage_moe(ctx: Context, result: dict, save: Callable) -> None:
    """One mixture layer at Qwen3-30B-A3B's shape, random weights: the Triton grouped GEMMs
    (kernels/fused_moe.py) against the torch loop over experts, milliseconds and the chosen experts'
    weight bytes read a second, and their largest difference."""
    import os

    import torch

    from spec_kernels import fused_moe

    shape = MOE_SHAPES["cpu" if ctx.dry else "gpu"]
    e, k, h, inter = shape["experts"], shape["top_k"], shape["hidden"], shape["inter"]
    g = torch.Generator(device=ctx.device).manual_seed(0)
    w_gate_up = torch.randn(e, 2 * inter, h, generator=g, device=ctx.device, dtype=ctx.dtype) / h ** 0.5
    w_down = torch.randn(e, h, inter, generator=g, device=ctx.device, dtype=ctx.dtype) / inter ** 0.5
    kernel = fused_moe.available() and (ctx.device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
    result.update(shape={k_: v for k_, v in shape.items() if k_ != "tokens"}, rows=[],
                  note=None if kernel else "Triton kernel not run: no CUDA and no TRITON_INTERPRET")
    for tokens in shape["tokens"]:
        x = torch.randn(tokens, h, generator=g, device=ctx.device, dtype=ctx.dtype)
        weights, ids = torch.randn(tokens, e, generator=g, device=ctx.device).softmax(-1).topk(k, dim=-1)
        weights = weights.to(ctx.dtype)
        chosen = ids.unique().numel() * (w_gate_up[0].numel() + w_down[0].numel()) * w_down.element_size()
        row = {"tokens": tokens, "experts_read": ids.unique().numel(), "weight_bytes": chosen}
        runs = {"torch_loop": fused_moe.fused_moe_reference} | ({"triton": fused_moe.fused_moe} if kernel else {})
        outs = {}
        for name, fn in runs.items():
            ms = timed_ms(lambda: fn(x, w_gate_up, w_down, weights, ids), ctx.plan["iters"], ctx.device)
            outs[name] = fn(x, w_gate_up, w_down, weights, ids).float()
            row[f"{name}_ms"] = round(ms, 4)
            row[f"{name}_gb_s"] = round(chosen / ms / 1e6, 1)
        if kernel:
            row["max_abs_diff"] = float((outs["triton"] - outs["torch_loop"]).abs().max())
        result["rows"].append(row)
        save()


def timed_ms(fn: Callable, iters: int, device: str) -> float:
    """Median milliseconds of fn() over `iters` calls, after one warm-up."""
    import statistics

    fn()
    times = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def stage_http(ctx: Context, result: dict, save: Callable) -> None:
    """`spec serve` on a tiny random model with its tokenizer (tests/tiny.py, written here), asked over
    HTTP (urllib): a sampled chat completion, one constrained by a JSON schema, one with logprobs."""
    from tests.tiny import make_model

    model = make_model(ctx.root / "http-model", "llama", seed=1)
    port = free_port()
    log = open(ctx.root / "serve.log", "w")
    cmd = [sys.executable, "-c", "from spec_cli.main import app; app()", "serve", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--max-total-tokens", "4096"]
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        name = wait_for_models(base, server)
        result["checks"] = {}
        for check, body, judge in http_checks(name):
            result["checks"][check] = run_check(base, body, judge)
            save()
        result["ok"] = all(c["ok"] for c in result["checks"].values())
    finally:
        stop(server)
        log.close()
        result["serve_log_tail"] = (ctx.root / "serve.log").read_text()[-2000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_models(base: str, server: subprocess.Popen, timeout: float = 120.0) -> str:
    """The served model's id, once /v1/models answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"spec serve exited with status {server.returncode} before answering")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as r:
                return json.loads(r.read())["data"][0]["id"]
        time.sleep(0.5)
    raise TimeoutError(f"spec serve did not answer /v1/models in {timeout:.0f} s")


def http_checks(model: str) -> Iterator[tuple[str, dict, Callable[[dict], bool]]]:
    chat = {"model": model, "messages": [{"role": "user", "content": "Say hello."}]}
    yield "sampling", {**chat, "temperature": 0.8, "top_p": 0.9, "seed": 1, "max_tokens": 16}, \
        lambda r: isinstance(r["choices"][0]["message"]["content"], str)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    yield "json_schema", {**chat, "max_tokens": 64, "temperature": 0,
                          "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}, \
        lambda r: r["choices"][0]["message"]["content"].lstrip().startswith("{")
    yield "logprobs", {**chat, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2}, \
        lambda r: len(r["choices"][0]["logprobs"]["content"]) > 0


def run_check(base: str, body: dict, judge: Callable[[dict], bool]) -> dict:
    request = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            answer = json.loads(r.read())
    except Exception as e:      # noqa: BLE001 - any failure of the request is this check's result
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    try:
        ok = bool(judge(answer))
    except (KeyError, IndexError, TypeError, AttributeError) as e:
        return {"ok": False, "error": f"unexpected answer ({e!r})", "answer": answer}
    return {"ok": ok, "content": answer["choices"][0]["message"]["content"][:200]}


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


STAGES: dict[str, Callable] = {"hbm": stage_hbm, "plain": stage_plain, "profile": stage_profile,
                               "speculation": stage_speculation, "controlled": stage_controlled,
                               "fp8": stage_fp8, "moe": stage_moe, "http": stage_http}


def run_stage(name: str, out: Path, dry: bool) -> int:
    """A stage's process: its measurements into out/stage-NAME.json, its error there too."""
    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")   # capture progress
    if not torch.cuda.is_available():
        torch.set_num_threads(1)            # a check, not a measurement: light on a shared machine
    path = out / f"stage-{name}.json"
    result: dict = {}

    def save() -> None:
        path.write_text(json.dumps(result, indent=2))

    with tempfile.TemporaryDirectory(prefix="spec-gpu-models-") as root:
        try:
            ctx = Context(dry, Path(root))
            result["device"] = ctx.device
            with ctx.weights():
                STAGES[name](ctx, result, save)
        except Exception as e:      # noqa: BLE001 - the stage's error is its result; the check goes on
            import traceback

            traceback.print_exc()
            result["error"] = f"{type(e).__name__}: {e}"
        save()
    return 1 if "error" in result else 0
