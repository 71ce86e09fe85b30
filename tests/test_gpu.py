"""The CUDA path, on a GPU: run by benchmarks/gpu_check.sh (pytest -m gpu tests/test_gpu.py, with
TRITON_INTERPRET=0), deselected from the default run and skipped without CUDA.

- Lossless: greedy output identical to plain decoding's for every algorithm, a chain and a tree, eager
  (torch attention) and with Triton attention + CUDA graphs; fp32, where equality holds on a GPU.
- CUDA graphs: a replayed decode or verify forward gives the bits of the same forward run eagerly, and
  reads the inputs it is replayed with.
- The Triton paged-attention and mixture-of-experts kernels, compiled, against their torch references; a
  mixture's experts in the kernel inside the graphs, speculation lossless on it.
- One host synchronisation per decode step (torch.cuda's sync debug mode counts them).
- FP8 layers (--quantization fp8, a block FP8 checkpoint): lossless relative to the FP8 target, in torch's
  FP8 GEMM where the card and torch's CUDA have it.
- Tensor parallelism over two GPUs, where there are two.
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

from engine import Engine
from engine.core.sampling_params import SamplingParams
from tests.drafts import ALGOS, draft_setup
from tests.tiny import make_model, random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"chain": (3, 1, 4), "tree": (3, 2, 6)}
MODES = {"eager": {"attention_backend": "torch", "disable_cuda_graph": True},
         "triton-graphs": {"attention_backend": "triton", "cuda_graph_max_bs": 8}}


@pytest.fixture(autouse=True)
def _compiled_triton():
    # tests/conftest.py picks Triton's interpreter unless told otherwise: on a GPU that would test numpy.
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("TRITON_INTERPRET=1: run TRITON_INTERPRET=0 pytest -m gpu tests/test_gpu.py "
                    "(benchmarks/gpu_check.sh does)")


def cuda_engine(model_dir, algo=None, shape=(3, 1, 4), **kw) -> Engine:
    spec = {}
    if algo:
        steps, topk, tokens = shape
        spec = dict(speculative_algorithm=algo, speculative_num_steps=steps, speculative_eagle_topk=topk,
                    speculative_num_draft_tokens=tokens)
    return Engine(**{"model_path": str(model_dir), "device": "cuda", "dtype": "float32", "max_total_tokens": 8192,
                     "max_running_requests": 8, **spec, **kw})


def greedy(eng: Engine, prompts, **params) -> list[list[int]]:
    return [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params={**GREEDY, **params})]


def prompts() -> list[list[int]]:
    return random_prompts(4, seed=11) + [[10, 11, 12, 13, 14, 15] * 5]     # repetitive: drafts get accepted


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("target"), "llama", seed=3)


@pytest.fixture(scope="module")
def plain(target):
    """Plain greedy outputs per mode (the reference is the target as served in that mode)."""
    return {mode: greedy(cuda_engine(target, **flags), prompts()) for mode, flags in MODES.items()}


# ---------------------------------------------------------------------------------------- lossless
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("algo", ALGOS)
def test_greedy_identical_on_cuda(algo, shape, mode, target, plain, tmp_path):
    kw = {**MODES[mode], **draft_setup(algo, target, tmp_path)}
    eng = cuda_engine(kw.pop("model_path", target), algo, SHAPES[shape], **kw)
    outs = eng.generate(input_ids=prompts(), sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == plain[mode]
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)
    if mode == "triton-graphs":
        assert eng.debug.target.graphs is not None and eng.debug.target.graphs._graphs, "no CUDA graph was captured"


# Mixtures whose experts run in the kernel: plain SwiGLU experts, and GPT-OSS's with biases and clamps.
MOE_TARGETS = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
               "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.0)}


@pytest.fixture(scope="module", params=list(MOE_TARGETS))
def moe_target(request, tmp_path_factory):
    return make_model(tmp_path_factory.mktemp(request.param), request.param, layers=2, seed=3,
                      **MOE_TARGETS[request.param])


@pytest.mark.parametrize("algo", ["NGRAM", "EAGLE3"])
def test_mixture_in_the_triton_kernel_is_lossless_on_cuda(algo, moe_target, tmp_path):
    """A mixture's experts on CUDA are stacked at load and run in kernels/fused_moe.py inside the captured
    graphs; speculation gives plain decoding's tokens on that target."""
    from engine.models.moe import Experts

    flags = MODES["triton-graphs"]
    plain_eng = cuda_engine(moe_target, **flags)
    experts = [m for m in plain_eng.debug.target.model.modules() if isinstance(m, Experts)]
    assert experts and all(m.stacked is not None for m in experts)
    expected = greedy(plain_eng, prompts())
    kw = {**flags, **draft_setup(algo, moe_target, tmp_path)}
    eng = cuda_engine(kw.pop("model_path", moe_target), algo, **kw)
    assert greedy(eng, prompts()) == expected


@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_fused_moe_kernel_matches_reference(tokens):
    """The Triton mixture kernel, compiled, at Qwen3-30B-A3B's layer shape in bf16, against its reference."""
    from spec_kernels import fused_moe

    g = torch.Generator(device="cuda").manual_seed(tokens)
    e, k, h, inter = 128, 8, 2048, 768
    w_gate_up = (torch.randn(e, 2 * inter, h, generator=g, device="cuda") / h ** 0.5).bfloat16()
    w_down = (torch.randn(e, h, inter, generator=g, device="cuda") / inter ** 0.5).bfloat16()
    x = torch.randn(tokens, h, generator=g, device="cuda").bfloat16()
    weights, ids = torch.randn(tokens, e, generator=g, device="cuda").softmax(-1).topk(k, dim=-1)
    got = fused_moe.fused_moe(x, w_gate_up, w_down, weights.bfloat16(), ids)
    torch.testing.assert_close(got, fused_moe.fused_moe_reference(x, w_gate_up, w_down, weights.bfloat16(), ids),
                               rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------- CUDA graphs
def random_decode_batch(eng: Engine, batch: int, tokens: int, context: int, seed: int):
    """`batch` requests of `tokens` new tokens (a causal tree past one) over `context` cached positions
    of random K/V, on table rows of their own: a decode or verify step as the worker lays it out."""
    from engine.core.forward_batch import make_batch

    g = torch.Generator().manual_seed(seed)
    kv, pool = eng.debug.kv, eng.debug.target.kv_pool
    for buf in pool.k + pool.v:
        buf[1:kv.pad_slot].normal_(generator=torch.Generator(buf.device).manual_seed(seed))
    slots = torch.randperm(kv.pad_slot - 1, generator=g)[:batch * (context + tokens)] + 1
    for b in range(batch):
        kv.table[1 + b, :context] = slots[b * context:(b + 1) * context].to(kv.table.device)
    out_slots = slots[batch * context:]                 # made outside inference mode, as the allocator's
    with torch.inference_mode():
        masks = torch.ones((batch, tokens, tokens), dtype=torch.bool, device=kv.table.device).tril() if tokens > 1 else None
        return make_batch(kv.table, list(range(1, batch + 1)), [context] * batch,
                          torch.randint(3, 300, (batch * tokens,), generator=g), out_slots, [tokens] * batch,
                          masks=masks)


@pytest.mark.parametrize("tokens", [1, 6], ids=["decode", "verify"])
def test_graph_replay_equals_eager(tokens, target):
    eng = cuda_engine(target, **MODES["triton-graphs"])
    runner = eng.debug.target
    graphs = runner.graphs
    with torch.inference_mode():
        for seed in (1, 2):     # the second replays the first's graph on new inputs
            batch = random_decode_batch(eng, 4, tokens, 40, seed)            # 4: a bucket, no padding
            replayed = runner.forward(batch, all_logits=True, decode=True).logits.clone()
            runner.graphs = None
            eager = runner.forward(batch, all_logits=True, decode=True).logits
            runner.graphs = graphs
            assert torch.equal(replayed, eager), f"max |diff| {(replayed - eager).abs().max().item():.3g}"
    assert any(key[0] == 4 and key[1] == tokens for key in graphs._graphs)


# ---------------------------------------------------------------------------------------- Triton kernel
def ragged_case(kinds: list[str], heads: int, kv_heads: int, dim: int, dtype, seed: int):
    """Arguments of paged_attention for requests of the given kinds (decode: 1 query; prefill: several,
    causal; tree: 6 nodes under an ancestor mask) over a random cache, on the GPU."""
    g = torch.Generator().manual_seed(seed)
    slots_total = 4096
    k_cache = torch.randn(slots_total, kv_heads, dim, generator=g)
    v_cache = torch.randn(slots_total, kv_heads, dim, generator=g)
    perm = torch.randperm(slots_total - 1, generator=g) + 1
    table = torch.zeros((len(kinds), 1024), dtype=torch.long)
    prefix, new, used = [], [], 0
    for b, kind in enumerate(kinds):
        p = int(torch.randint(0, 700, (1,), generator=g))
        n = {"decode": 1, "prefill": int(torch.randint(2, 40, (1,), generator=g)), "tree": 6}[kind]
        table[b, :p] = perm[used:used + p]
        prefix.append(p), new.append(n)
        used += p
    tails = torch.zeros((len(kinds), max(new)), dtype=torch.long)
    for b, n in enumerate(new):
        tails[b, :n] = perm[used:used + n]
        used += n
    mask = None
    if "tree" in kinds:         # node i sees itself and its ancestors (parents 0,0,1,1,2); others causal
        mask = torch.ones((len(kinds), max(new), max(new)), dtype=torch.bool).tril()
        tree = torch.eye(6, dtype=torch.bool)
        for i, parent in enumerate([-1, 0, 0, 1, 1, 2]):
            if parent >= 0:
                tree[i] |= tree[parent]
        for b, kind in enumerate(kinds):
            if kind == "tree":
                mask[b, :6, :6] = tree
    qo_indptr = torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(new).cumsum(0)])
    q = torch.randn(sum(new), heads, dim, generator=g)
    args = [q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), qo_indptr, table, torch.arange(len(kinds)),
            torch.tensor(prefix), tails, torch.tensor(new), mask, dim ** -0.5]
    return [a.cuda() if isinstance(a, torch.Tensor) else a for a in args], max(new)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 16), (32, 8, 128), (14, 2, 64)],
                         ids=["tiny", "llama-8b", "qwen-0.5b"])
@pytest.mark.parametrize("kinds", [["decode"] * 3, ["prefill", "prefill"], ["tree", "tree"],
                                   ["decode", "tree", "prefill"]], ids=["decode", "prefill", "tree", "mixed"])
def test_triton_kernel_matches_reference(kinds, heads, kv_heads, dim, dtype):
    from spec_kernels.paged_attention import attention_reference, paged_attention

    args, max_queries = ragged_case(kinds, heads, kv_heads, dim, dtype, seed=len(kinds) + dim)
    got = paged_attention(*args, max_queries).float().cpu()
    want = attention_reference(*[a.cpu().float() if isinstance(a, torch.Tensor) and a.is_floating_point()
                                 else a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    # tl.dot takes fp32 inputs as TF32 on these GPUs: agreement to TF32's precision, not bit for bit.
    tol = 2e-2 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------- host syncs
def syncs_per_decode_step(eng: Engine, steps: int = 6) -> list[Counter]:
    """Per decode step (after every request's prefill), the synchronising CUDA calls it made, by the
    line that made them and, when that line is a library's, the innermost line of spec's that led there."""
    reqs = [eng.make_request(p, SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)) for p in prompts()]
    for req in reqs:
        eng.add_request(req)
    while any(r.num_output == 0 for r in reqs):
        eng.step()
    counts = []
    for _ in range(steps):
        sites: Counter = Counter()

        def record(message, category, filename, lineno, file=None, line=None):
            # Not torch's one-time notice that the debug mode is a prototype ("Synchronization debug mode ...").
            if "called a synchronizing" in str(message):
                sites[sync_site(filename, lineno)] += 1

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                eng.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sites)
    eng.abort_all()
    return counts


def sync_site(filename: str, lineno: int) -> str:
    site = f"{filename}:{lineno}"
    ours = [f for f in traceback.extract_stack() if f.filename.startswith(str(ROOT / "engine"))
            or f.filename.startswith(str(ROOT / "kernels"))]
    if ours and ours[-1].filename != filename:
        site += f" (from {Path(ours[-1].filename).relative_to(ROOT)}:{ours[-1].lineno})"
    return site


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("algo", [None, "EAGLE3", "NGRAM"])
def test_one_host_sync_per_decode_step(algo, mode, target, tmp_path):
    kw = {**MODES[mode], **draft_setup(algo, target, tmp_path)} if algo else dict(MODES[mode])
    eng = cuda_engine(kw.pop("model_path", target), algo, SHAPES["tree"], **kw)
    counts = syncs_per_decode_step(eng)
    worst = max(counts, key=lambda c: sum(c.values()))
    assert sum(worst.values()) <= 1, f"{[sum(c.values()) for c in counts]} syncs per step; worst step's: {dict(worst)}"


# ---------------------------------------------------------------------------------------- FP8
@pytest.fixture(scope="module")
def aligned_target(tmp_path_factory):
    """Every layer 128-aligned, so that FP8 block scales reach torch's blockwise GEMM too."""
    return make_model(tmp_path_factory.mktemp("aligned"), "llama", hidden=256, seed=8)


@pytest.mark.parametrize("weights", ["online", "block-checkpoint"])
@pytest.mark.parametrize("algo", ["EAGLE3", "NGRAM"])
def test_fp8_greedy_identical_on_cuda(algo, weights, aligned_target, tmp_path, caplog):
    """--quantization fp8 (a float checkpoint rounded per channel) and a block FP8 checkpoint as stored:
    speculative greedy output equals plain decoding's on the FP8 target as served, and on compute
    capability 8.9+ the layers multiply in torch's FP8 GEMM."""
    import logging

    from tests.fp8_checkpoints import save_fp8_checkpoint

    model = aligned_target if weights == "online" else save_fp8_checkpoint(aligned_target, tmp_path / "fp8", (128, 128))[0]
    kw = {"quantization": "fp8", **MODES["triton-graphs"]}
    with caplog.at_level(logging.INFO, logger="engine.core.model_runner"):
        expected = greedy(cuda_engine(model, **kw), prompts())
    capability, cuda = torch.cuda.get_device_capability(), tuple(map(int, torch.version.cuda.split(".")))
    # Row-wise scales from Ada on; torch's blockwise GEMM on Hopper with CUDA 12.9+.
    in_gemm = capability >= (8, 9) if weights == "online" else capability == (9, 0) and cuda >= (12, 9)
    if in_gemm:
        assert "8 scaled_mm" in caplog.text, caplog.text
    setup = draft_setup(algo, aligned_target, tmp_path)
    outs = cuda_engine(model, algo, SHAPES["chain"], **kw, **setup).generate(input_ids=prompts(), sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == expected
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)


# ---------------------------------------------------------------------------------------- tensor parallel
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("algo", [None, "EAGLE3"])
def test_tensor_parallel_two_gpus(algo, target, tmp_path):
    kw = draft_setup(algo, target, tmp_path) if algo else {}
    model = kw.pop("model_path", target)
    expected = greedy(cuda_engine(model, algo, **kw), prompts())
    with cuda_engine(model, algo, tp_size=2, **kw) as eng:
        assert greedy(eng, prompts()) == expected
