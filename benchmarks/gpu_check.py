"""The GPU check: proves spec's CUDA path in one command, on a GPU machine lent for a few minutes.

On a bare GPU machine (Python 3.12 with torch, triton, transformers; spec not installed, no network), from
the repository root, with the wheels fetched beforehand here (`bash benchmarks/fetch_gpu_wheels.sh`) and
carried there (device tool: carry ["benchmarks/gpu_wheels"]):

    bash benchmarks/gpu_check.sh --out "$OUT"

1. Installs the carried wheels (benchmarks/gpu_wheels/) into a temporary folder, which goes on PYTHONPATH
   with the repository root and a link spec_kernels -> kernels/ (pyproject.toml's package-dir mapping).
   Skipped where spec's dependencies import already.
2. Runs the GPU tests: pytest -m gpu tests/test_gpu.py, each test function in a process of its own (a
   CUDA error spoils its process), with Triton compiled (TRITON_INTERPRET=0).
3. Benchmarks a Llama-3.1-8B-shaped model with random bf16 weights made on the device (no checkpoint):
   decode tokens/s at batch 1 and 16, eager (torch attention) and with Triton attention + CUDA graphs;
   the verify cost (an 8-token forward against a 1-token one); the step of a 1-layer EAGLE-3-shaped
   random head through the EAGLE3 path; beside SGLang's published figure and the memory-bandwidth floor.
4. Prints a summary table and writes report.md and report.json, with the logs, into the output folder.

--cpu-dry-run runs the same steps on the CPU at tiny shapes (Triton in its interpreter, the GPU tests
skipped), so that the script is exercised by the default test run (tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "benchmarks" / "gpu_wheels"
# spec's dependencies that a bare GPU machine lacks (benchmarks/fetch_gpu_wheels.sh fetches them).
NEEDED = ("fastapi", "uvicorn", "pydantic", "gguf", "xgrammar")
# SGLang, plain decoding, Llama-3.1-8B on one H100, batch 1: the figure issue 42 compares against.
SGLANG_PLAIN_TOK_S = 158.0
# Seconds per stage: the whole check must stay under 8 minutes on an H100.
TESTS_TIMEOUT_S, BENCH_TIMEOUT_S = 270, 150

LLAMA_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=14336, vocab_size=128256, rope_theta=500000.0)
TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=320, rope_theta=10000.0)
# EAGLE-3 heads published for Llama-3.1-8B keep 32k draft tokens.
EAGLE3_DRAFT_VOCAB = {"gpu": 32000, "cpu": 200}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=os.environ.get("OUT") or None,
                   help="folder for report.md, report.json and the logs (default: $OUT)")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="tiny shapes on the CPU, Triton in its interpreter: checks the script, measures nothing")
    p.add_argument("--skip-tests", action="store_true", help="benchmark only")
    p.add_argument("--skip-bench", action="store_true", help="GPU tests only")
    p.add_argument("--bench-child", action="store_true", help=argparse.SUPPRESS)   # the benchmark's own process
    args = p.parse_args(argv)
    if args.out is None:
        p.error("give --out DIR or set $OUT")
    return args


# ------------------------------------------------------------------------------------------------ setup
def prepare_site(site: Path, out: Path) -> dict:
    """Fill `site`, a folder for PYTHONPATH: the carried wheels installed in it (unless spec's dependencies
    import already) and spec_kernels linked to kernels/. Returns what was done."""
    (site / "spec_kernels").symlink_to(ROOT / "kernels", target_is_directory=True)
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if not missing:
        return {"installed": [], "note": "dependencies import already; no wheels installed"}
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"error: {', '.join(missing)} do not import and {WHEELS} holds no wheels: run "
                         "bash benchmarks/fetch_gpu_wheels.sh where PyPI is reachable, and carry "
                         "benchmarks/gpu_wheels to this machine.")
    if importlib.util.find_spec("pip") is None:
        raise SystemExit(f"error: {sys.executable} has no pip to install {WHEELS}'s wheels with.")
    say(f"installing {len(wheels)} wheels into {site}")
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--find-links", str(WHEELS),
           "--target", str(site), "--disable-pip-version-check", *map(str, wheels)]
    with open(out / "install.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"error: installing the wheels failed (exit {rc}); see {out / 'install.log'}")
    return {"installed": [w.name for w in wheels], "target": str(site)}


def say(message: str) -> None:
    """Progress on stdout as it happens: a run cut short shows where it was."""
    print(f"[gpu_check] {message}", flush=True)


def child_env(site: Path, dry: bool) -> dict:
    """The environment of the test and benchmark processes: the site folder and the repository first on
    PYTHONPATH; Triton compiled on a GPU (tests/conftest.py would choose its interpreter), interpreted
    in the dry run."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(ROOT), env.get("PYTHONPATH")]))
    env["TRITON_INTERPRET"] = "1" if dry else "0"
    return env


def run_logged(cmd: list[str], env: dict, log_path: Path, timeout: int) -> tuple[int, float]:
    """Run cmd with its output in log_path (and echoed when it ends); (exit code, seconds). A command
    past `timeout` is killed and reported as exit code 124."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            log.write(f"\n[gpu_check] killed after {timeout} s\n")
            rc = 124
    return rc, time.perf_counter() - start


# ------------------------------------------------------------------------------------------------ tests
def run_tests(env: dict, out: Path) -> dict:
    """Each test function of tests/test_gpu.py in a pytest process of its own: a CUDA error is sticky (an
    illegal memory access spoils the process's context), so one failing test must not fail the rest."""
    names = re.findall(r"^def (test_\w+)\(", (ROOT / "tests" / "test_gpu.py").read_text(), re.M)
    say(f"GPU tests: {len(names)} functions, one process each (at most {TESTS_TIMEOUT_S} s in all), "
        f"log in {out / 'pytest.log'}")
    totals = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    worst, seconds = 0, 0.0
    with open(out / "pytest.log", "w") as log:
        for name in names:
            xml, part = out / f"pytest-{name}.xml", out / f"pytest-{name}.log"
            cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfEs", "-p", "no:cacheprovider",
                   f"--junitxml={xml}", f"tests/test_gpu.py::{name}"]
            rc, took = run_logged(cmd, env, part, max(10, int(TESTS_TIMEOUT_S - seconds)))
            log.write(f"===== {name} (exit {rc}, {took:.1f} s)\n{part.read_text()}\n")
            counts = junit_counts(xml)
            xml.unlink(missing_ok=True)
            part.unlink()
            for key in totals:
                totals[key] += counts[key]
            worst, seconds = worst or rc, seconds + took
    return {"rc": worst, "seconds": round(seconds, 1), **totals}


def junit_counts(xml: Path) -> dict:
    """passed / failed / errors / skipped, and the failing tests' ids, from pytest's JUnit XML."""
    if not xml.is_file():
        return {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": ["no pytest.xml: see pytest.log"]}
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    for case in ElementTree.parse(xml).getroot().iter("testcase"):
        kind = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), None)
        key = {"failure": "failed", "error": "errors", "skipped": "skipped"}.get(kind, "passed")
        counts[key] += 1
        if key in ("failed", "errors"):
            failures.append(f"{case.get('classname')}::{case.get('name')}")
    return {**counts, "failures": failures}


# ------------------------------------------------------------------------------------------------ benchmark
def run_bench(env: dict, out: Path, dry: bool) -> dict:
    """The benchmark in its own process (a clean CUDA context, a time limit); what it measured comes back
    through bench.json, written after each measurement, so a run cut short keeps what it finished."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--bench-child", "--out", str(out)]
    say(f"benchmark (at most {BENCH_TIMEOUT_S} s), log in {out / 'bench.log'}")
    rc, seconds = run_logged(cmd + (["--cpu-dry-run"] if dry else []), env, out / "bench.log", BENCH_TIMEOUT_S)
    path = out / "bench.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    return {**result, "rc": rc, "seconds": round(seconds, 1)}


def bandwidth_bytes_per_s(device_name: str) -> Optional[float]:
    """HBM bandwidth by device name (NVIDIA's datasheets), None where unknown."""
    if "H200" in device_name:
        return 4.8e12
    if "H100" in device_name and "PCIe" in device_name:
        return 2.0e12
    if "H100" in device_name and ("SXM" in device_name or "HBM3" in device_name):
        return 3.35e12
    return None


def tensor_shapes(config: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of a Llama checkpoint with this config, as Hugging Face names them."""
    h, v = config["hidden_size"], config["vocab_size"]
    yield "model.embed_tokens.weight", (v, h)
    for layer in range(config["num_hidden_layers"]):
        yield from decoder_layer_shapes(f"model.layers.{layer}", config, h)
        yield f"model.layers.{layer}.input_layernorm.weight", (h,)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (v, h)


def decoder_layer_shapes(prefix: str, config: dict, in_features: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Attention and MLP of one layer whose q/k/v read `in_features` (EAGLE-3's read twice the hidden)."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    yield from ((f"{prefix}.self_attn.q_proj.weight", (q, in_features)),
                (f"{prefix}.self_attn.k_proj.weight", (kv, in_features)),
                (f"{prefix}.self_attn.v_proj.weight", (kv, in_features)),
                (f"{prefix}.self_attn.o_proj.weight", (h, q)),
                (f"{prefix}.mlp.gate_proj.weight", (inter, h)), (f"{prefix}.mlp.up_proj.weight", (inter, h)),
                (f"{prefix}.mlp.down_proj.weight", (h, inter)),
                (f"{prefix}.post_attention_layernorm.weight", (h,)))


def eagle3_shapes(config: dict, draft_vocab: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """An EAGLE-3 head's float tensors, named as SpecForge saves them (d2t comes separately)."""
    h = config["hidden_size"]
    yield "fc.weight", (h, 3 * h)
    yield from decoder_layer_shapes("midlayer", config, 2 * h)
    yield from ((f"midlayer.{n}.weight", (h,)) for n in ("input_layernorm", "hidden_norm"))
    yield "norm.weight", (h,)
    yield "lm_head.weight", (draft_vocab, h)


def random_tensors(shapes, dtype, device) -> Iterator[tuple[str, "torch.Tensor"]]:
    """Random weights made on the device, one at a time: norms 1, matrices N(0, 0.02). Decode speed does
    not depend on the values."""
    import torch

    for name, shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        yield name, t.fill_(1.0) if len(shape) == 1 else t.normal_(0.0, 0.02)


@contextlib.contextmanager
def random_checkpoints(weights: dict):
    """Make engine.loader.iter_weights yield weights[model_dir]() for the given directories: the engine
    loads these models through its own loader, from no file."""
    import engine.loader as loader

    real = loader.iter_weights

    def iter_weights(model_dir, select=None):
        make = weights.get(Path(model_dir).resolve())
        if make is None:
            yield from real(model_dir, select)
            return
        yield from ((name, t) for name, t in make() if select is None or select(name))

    loader.iter_weights = iter_weights
    try:
        yield
    finally:
        loader.iter_weights = real


def write_model_dirs(root: Path, config: dict, draft_vocab: int) -> tuple[Path, Path]:
    """The target's and the EAGLE-3 head's directories: config.json, the tiny test tokenizer (the
    benchmark feeds token ids) and an empty model.safetensors, so the loader accepts them."""
    from safetensors.torch import save_file

    from tests.tiny import make_tokenizer

    target, draft = root / "target", root / "eagle3"
    common = {"model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
              "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16"}
    configs = {target: {**common, **config, "architectures": ["LlamaForCausalLM"]},
               draft: {**common, **config, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
                       "draft_vocab_size": draft_vocab}}
    for path, cfg in configs.items():
        path.mkdir(parents=True)
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
        save_file({}, str(path / "model.safetensors"))
    make_tokenizer(target)
    return target, draft


def checkpoint_makers(target: Path, draft: Path, config: dict, draft_vocab: int, dtype, device) -> dict:
    import torch

    def eagle3():
        yield from random_tensors(eagle3_shapes(config, draft_vocab), dtype, device)
        ids = torch.randperm(config["vocab_size"])[:draft_vocab].sort().values
        yield "d2t", ids - torch.arange(draft_vocab)        # on the CPU, as read from a file

    return {target.resolve(): lambda: random_tensors(tensor_shapes(config), dtype, device),
            draft.resolve(): eagle3}


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def timed_generate(eng, prompts: list[list[int]], new_tokens: int, device: str) -> tuple[float, list[dict]]:
    sync(device)
    start = time.perf_counter()
    outs = eng.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": new_tokens,
                                                              "ignore_eos": True})
    sync(device)
    return time.perf_counter() - start, outs


def decode_speed(eng, batch: int, new_tokens: int, prompt_len: int, device: str) -> dict:
    """Decode tokens/s of `batch` requests: generating new_tokens less generating one (the prefill and
    the first token), so prefill does not count."""
    prompts = [[3 + (b * 7 + i) % 300 for i in range(prompt_len)] for b in range(batch)]
    timed_generate(eng, prompts, 4, device)                                # warm-up: kernels compiled
    t_one, _ = timed_generate(eng, prompts, 1, device)
    t_all, outs = timed_generate(eng, prompts, new_tokens, device)
    steps = max(1, max(o["meta_info"].get("spec_verify_ct", 0) for o in outs)) if eng.args.speculative_algorithm \
        else new_tokens - 1
    decode_s = max(t_all - t_one, 1e-9)
    return {"decode_tok_s": round(batch * (new_tokens - 1) / decode_s, 1), "ms_per_step": round(decode_s / steps * 1e3, 3),
            "steps": steps}


def forward_ms(eng, batch: int, tokens: int, context: int, iters: int, device: str) -> float:
    """Milliseconds of one target forward of `batch` requests x `tokens` new tokens (a causal tree when
    tokens > 1) after `context` cached positions, logits for every token, as a decode or verify step runs
    it (replayed from a CUDA graph where the engine captures them). The requests sit on the KV manager's
    padding row and slot, as graph warm-up's dummy requests do."""
    import torch

    from engine.forward_batch import make_batch

    kv, runner = eng._kv, eng._target
    slots = torch.full((batch * tokens,), kv.pad_slot, dtype=torch.long)       # made outside inference mode
    with torch.inference_mode():
        masks = torch.ones((batch, tokens, tokens), dtype=torch.bool, device=kv.table.device).tril() if tokens > 1 else None
        step = make_batch(kv.table, [kv.pad_row] * batch, [context] * batch,
                          torch.zeros(batch * tokens, dtype=torch.long), slots, [tokens] * batch, masks=masks)
        for _ in range(3):
            runner.forward(step, all_logits=True, decode=True)
        sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            runner.forward(step, all_logits=True, decode=True)
        sync(device)
    return (time.perf_counter() - start) / iters * 1e3


def bench_plan(dry: bool) -> dict:
    if dry:
        return {"config": TINY, "dtype": "float32", "batches": [1, 2], "new_tokens": 8, "prompt_len": 8,
                "context": 32, "iters": 2, "draft_vocab": EAGLE3_DRAFT_VOCAB["cpu"]}
    return {"config": LLAMA_8B, "dtype": "bfloat16", "batches": [1, 16], "new_tokens": 256, "prompt_len": 32,
            "context": 512, "iters": 20, "draft_vocab": EAGLE3_DRAFT_VOCAB["gpu"]}


VARIANTS = {"eager": {"attention_backend": "torch", "disable_cuda_graph": True},
            "triton+graphs": {"attention_backend": "triton"}}


def bench_child(out: Path, dry: bool) -> None:
    """The benchmark's process: the model directories, then the measurements, into bench.json."""
    import logging

    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")   # capture progress
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)            # a check, not a measurement: light on a shared machine
    plan = bench_plan(dry)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    result = {"device": name, "model": plan["config"], "dtype": plan["dtype"], "new_tokens": plan["new_tokens"],
              "bandwidth_bytes_per_s": bandwidth_bytes_per_s(name), "reference_tok_s": SGLANG_PLAIN_TOK_S,
              "rows": [], "eagle3": None}

    def save() -> None:
        (out / "bench.json").write_text(json.dumps(result, indent=2))

    dtype = getattr(torch, plan["dtype"])
    with tempfile.TemporaryDirectory(prefix="spec-gpu-models-") as root:
        target, draft = write_model_dirs(Path(root), plan["config"], plan["draft_vocab"])
        measure(result, save, target, draft, plan, dtype, device)


def measure(result: dict, save, target: Path, draft: Path, plan: dict, dtype, device: str) -> None:
    """Every measurement into `result`, each saved as soon as it is made."""
    import torch

    from engine import Engine

    batches = plan["batches"]
    with random_checkpoints(checkpoint_makers(target, draft, plan["config"], plan["draft_vocab"], dtype, device)):
        for variant, flags in VARIANTS.items():
            eng = Engine(model_path=str(target), dtype=plan["dtype"], max_running_requests=max(batches),
                         cuda_graph_max_bs=max(batches), max_total_tokens=16384, context_length=2048,
                         grammar_backend="none", disable_radix_cache=True, **flags)
            result["weight_bytes"] = eng._target.model.weight_bytes
            for batch in batches:
                speed = decode_speed(eng, batch, plan["new_tokens"], plan["prompt_len"], device)
                row = {"variant": variant, "batch": batch, **speed}
                one, eight = (forward_ms(eng, batch, n, plan["context"], plan["iters"], device) for n in (1, 8))
                row.update(forward_1_ms=round(one, 3), forward_8_ms=round(eight, 3), verify8_cost=round(eight / one, 2))
                result["rows"].append(row)
                print(row, flush=True)
                save()
            if variant == "triton+graphs":
                # this variant's first row: batch 1
                result["eagle3"] = eagle3_step(eng, draft, plan, device, result["rows"][-len(batches)])
                save()
            eng.shutdown()
            del eng
            if device == "cuda":
                torch.cuda.empty_cache()


def eagle3_step(eng, draft: Path, plan: dict, device: str, plain: dict) -> dict:
    """The EAGLE3 path's decode step at batch 1 with the random head (3 draft steps, a chain of 4 verified
    tokens), beside the same engine's plain step (`plain`: its batch-1 row). Random drafts are rarely
    accepted: this is a cost, not a speed-up."""
    eng.set_speculative(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft),
                        speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
    spec = decode_speed(eng, 1, plan["new_tokens"], plan["prompt_len"], device)
    return {"tree": "3 steps, topk 1, 4 tokens", **spec, "plain_ms_per_step": plain["ms_per_step"]}


# ------------------------------------------------------------------------------------------------ report
def summary_lines(report: dict) -> list[str]:
    """The report as a Markdown document: the tests, then the benchmark table."""
    lines = [f"# GPU check ({report['mode']})", "", f"- device: {report['device']}", f"- torch {report['torch']}, "
             f"triton {report['triton']}, CUDA {report['cuda']}", f"- wheels: {install_line(report['install'])}",
             f"- took {report['elapsed_s']} s", ""]
    tests = report.get("tests")
    if tests:
        lines += ["## GPU tests (pytest -m gpu tests/test_gpu.py)", "",
                  f"{tests['passed']} passed, {tests['failed']} failed, {tests['errors']} errors, "
                  f"{tests['skipped']} skipped in {tests['seconds']} s (exit {tests['rc']}; pytest.log)", ""]
        lines += [f"- failed: `{f}`" for f in tests["failures"]] + ([""] if tests["failures"] else [])
    bench = report.get("bench")
    if bench:
        lines += bench_lines(bench)
    return lines


def install_line(install: dict) -> str:
    if not install["installed"]:
        return install["note"]
    return f"{len(install['installed'])} installed into {install['target']} (install.log)"


def bench_lines(bench: dict) -> list[str]:
    model = bench.get("model", {})
    lines = ["## Benchmark (bench.log)", "",
             f"Model: hidden {model.get('hidden_size')}, {model.get('num_hidden_layers')} layers, "
             f"{model.get('num_attention_heads')}/{model.get('num_key_value_heads')} heads, intermediate "
             f"{model.get('intermediate_size')}, vocab {model.get('vocab_size')}, random {bench.get('dtype')} weights; "
             f"{bench.get('new_tokens')} new tokens per request (exit {bench['rc']}, {bench['seconds']} s).", ""]
    floor = floor_ms(bench)
    lines += ["| variant | batch | decode tok/s | ms/step | 1-token fwd ms | 8-token fwd ms | verify-8 cost | floor tok/s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in bench.get("rows", []):
        ceiling = "unknown" if floor is None else f"{r['batch'] / floor * 1e3:.0f}"
        lines.append(f"| {r['variant']} | {r['batch']} | {r['decode_tok_s']} | {r['ms_per_step']} | {r['forward_1_ms']} "
                     f"| {r['forward_8_ms']} | {r['verify8_cost']}x | {ceiling} |")
    lines += ["", f"- SGLang plain, Llama-3.1-8B, one H100, batch 1: {bench.get('reference_tok_s')} tok/s (published).",
              "- floor: the weights read once per step at the device's HBM bandwidth "
              + ("(unknown for this device)." if floor is None else
                 f"({bench['weight_bytes'] / 2**30:.1f} GiB at {bench['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s: "
                 f"{floor:.2f} ms a step).")]
    eagle3 = bench.get("eagle3")
    lines.append(f"- EAGLE3 step, batch 1, {eagle3['tree']}: {eagle3['ms_per_step']} ms "
                 f"({eagle3['steps']} steps; plain step {eagle3['plain_ms_per_step']} ms)." if eagle3 else
                 "- EAGLE3 step: not measured (the run ended before it; see bench.log).")
    return lines + [""]


def floor_ms(bench: dict) -> Optional[float]:
    bandwidth, weights = bench.get("bandwidth_bytes_per_s"), bench.get("weight_bytes")
    return None if not bandwidth or not weights else weights / bandwidth * 1e3


def versions() -> dict:
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (no CUDA)"
    return {"device": device, "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda}


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.bench_child:
        bench_child(out, args.cpu_dry_run)
        return 0
    start = time.perf_counter()
    report = {"mode": "cpu-dry-run" if args.cpu_dry_run else "gpu", **versions()}
    with tempfile.TemporaryDirectory(prefix="spec-gpu-site-") as site:
        report["install"] = prepare_site(Path(site), out)
        env = child_env(Path(site), args.cpu_dry_run)
        if not args.skip_tests:
            report["tests"] = run_tests(env, out)
        if not args.skip_bench:
            report["bench"] = run_bench(env, out, args.cpu_dry_run)
    report["elapsed_s"] = round(time.perf_counter() - start, 1)
    text = "\n".join(summary_lines(report))
    (out / "report.md").write_text(text)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(text)
    ok = report.get("tests", {}).get("rc", 0) == 0 and report.get("bench", {}).get("rc", 0) == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
