"""spec against llama.cpp on the same GGUF files: decode speed, speculative modes, verify cost, RSS,
time to first request. llama.cpp on the same file is the yardstick for CPU speed.

    python benchmarks/bench_llamacpp.py [--prompts 4] [--max-new-tokens 128] [--rounds 2] [--eagle3 MODEL=DIR]
                                        [--head-quantization w4a8] [--eagle3-tree 2,4,4]

Greedy, batch 1, MT-Bench first turns (one per category) through each model's chat template, 2
threads. Every case runs in a process of its own (its peak RSS is its own), and the cases of a model
run interleaved round by round (llama.cpp, spec, llama.cpp, ...), so a machine getting busier or
quieter moves them alike; figures are medians over rounds and prompts.

- llama.cpp plain: `llama-bench -p 0 -n N` (decode of N tokens after an empty prompt: its generation
  speed does not depend on the text); its verify cost from `llama-bench -p 8 -n 16 -d 512` (an 8-token
  batch against a decoded token, both after 512 cached tokens). Speculative: `llama-speculative-simple` with a draft model
  (`--spec-type draft-simple`, 8 draft tokens) or its n-gram cache (`--spec-type ngram-cache`), on the
  same prompts as spec; its "decoded ... speed" line.
- spec: an Engine with the defaults (a GGUF's own 4-bit layers on the CPU), plain and speculative
  (NGRAM; STANDALONE with the 0.5B draft for Qwen2.5-Coder-1.5B; EAGLE3 with --eagle3 DIR), decode
  tokens/s = (new tokens - 1) / (time after the first token); the time to first request is start-up
  (loading, converting once, warming up) plus the first request's first token; and the cost of an
  8-token verify forward against a 1-token forward (chain, 512 cached tokens, model alone).

llama.cpp's tools are built once, from the llama.cpp that PyPI's llama-cpp-python sdist vendors, into
~/.cache/spec/llama.cpp (cmake and a C++ compiler; ~5 min on 2 cores); --llama-bin DIR uses tools built
elsewhere. On a CPU with AMX they are built without ggml's AMX kernels (every other native extension
named, since -march=native compiles them in): those crash on some VMs (SIGILL on tilezero, or a
general-protection fault in ldtilecfg, both seen on the development machine), while oneDNN's AMX, which
spec uses, runs there. The models: `spec fetch smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b`.
Run it alone: a second busy process on 2 cores skews every number.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
MT_BENCH = HERE.parent / "shared" / "datasets" / "mt_bench" / "question.jsonl"
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
TOOLS = ("llama-bench", "llama-speculative-simple")
DRAFTS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}


# ------------------------------------------------------------------ llama.cpp
def build_llama_cpp(cache: Path, tools: tuple[str, ...] = TOOLS) -> Path:
    """The directory of llama.cpp's tools, each built the first time it is asked for."""
    bin_dir = cache / "build" / "bin"
    if all((bin_dir / t).is_file() for t in tools):
        return bin_dir
    cache.mkdir(parents=True, exist_ok=True)
    print(f"# building llama.cpp ({LLAMA_CPP_PYTHON}'s vendored copy) into {cache}, once", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "download", LLAMA_CPP_PYTHON, "--no-deps", "--no-binary", ":all:",
                    "-d", str(cache)], check=True)
    sdist = next(cache.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        tar.extractall(cache, filter="data")
    src = next(cache.glob("llama_cpp_python-*/vendor/llama.cpp"))
    server = "ON" if "llama-server" in tools else "OFF"
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", f"-DLLAMA_BUILD_SERVER={server}",
             "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DGGML_NATIVE=ON"]
    if "amx" in cpu_flags():
        # -march=native compiles ggml's AMX kernels in, which crash on VMs that do not grant AMX to the
        # process (SIGILL on tilezero, or a general-protection fault in ldtilecfg): every other native
        # extension, named one by one.
        flags = [f for f in flags if f != "-DGGML_NATIVE=ON"] + ["-DGGML_NATIVE=OFF"] + [
            f"-D{option}=ON" for flag, option in X86_OPTIONS.items() if flag in cpu_flags(all_flags=True).split()]
    subprocess.run(["cmake", "-S", str(src), "-B", str(cache / "build"), *flags], check=True)
    subprocess.run(["cmake", "--build", str(cache / "build"), "-j", str(os.cpu_count() or 2), "--target", *tools],
                   check=True)
    return bin_dir


def cpu_flags(all_flags: bool = False) -> str:
    """The CPU's vector flags (every flag with all_flags)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return " ".join(sorted({f for f in text.split() if all_flags or f.startswith(("avx", "amx"))}))


# /proc/cpuinfo flag -> ggml's cmake option for it, for builds without -march=native.
X86_OPTIONS = {"sse4_2": "GGML_SSE42", "f16c": "GGML_F16C", "fma": "GGML_FMA", "bmi2": "GGML_BMI2", "avx": "GGML_AVX",
               "avx2": "GGML_AVX2", "avx_vnni": "GGML_AVX_VNNI", "avx512f": "GGML_AVX512",
               "avx512vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16"}


def llama_bench(bin_dir: Path, gguf: Path, *args: str) -> list[dict]:
    """llama-bench's JSON rows for these arguments, on 2 threads."""
    return json.loads(subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", "2", *args, "-o", "json"],
                                     check=True, capture_output=True, text=True).stdout)


def llama_plain(bin_dir: Path, gguf: Path, new_tokens: int) -> dict:
    tok_s = llama_bench(bin_dir, gguf, "-p", "0", "-n", str(new_tokens), "-r", "1")[0]["avg_ts"]
    # Its own verify cost, as spec's is measured: 8 tokens in one batch against 1, after 512 cached tokens.
    runs = llama_bench(bin_dir, gguf, "-p", "8", "-n", "16", "-d", "512", "-r", "2")
    batch8 = next(r["avg_ts"] for r in runs if r["n_prompt"] == 8)
    step = next(r["avg_ts"] for r in runs if r["n_gen"] == 16)
    return {"tok_s": tok_s, "verify8": 8 * step / batch8}


def llama_speculative(bin_dir: Path, gguf: Path, prompt: str, new_tokens: int, draft: Path | None) -> dict:
    kind = ["-md", str(draft), "--spec-type", "draft-simple"] if draft else ["--spec-type", "ngram-cache"]
    log = subprocess.run([str(bin_dir / "llama-speculative-simple"), "-m", str(gguf), "-p", prompt, "-n", str(new_tokens),
                          "-t", "2", "--temp", "0", "--spec-draft-n-max", "8", *kind],
                         capture_output=True, text=True).stderr
    decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    if decoded is None:
        raise RuntimeError(f"llama-speculative-simple failed:\n{log[-2000:]}")
    accept = re.search(r"accept\s+=\s+([\d.]+)%", log)
    return {"tok_s": int(decoded[1]) / float(decoded[2]), "accept_pct": float(accept[1]) if accept else None}


# ------------------------------------------------------------------ spec (in a child process)
def spec_case(model: str, spec: dict, prompts: list[list[int]] | None, new_tokens: int) -> dict:
    start = time.perf_counter()
    import torch

    from engine import Engine
    from engine.core.sampling_params import SamplingParams

    torch.set_num_threads(2)
    eng = Engine(model_path=model, **spec)
    ids = prompts if prompts is not None else chat_prompts(eng.tokenizer, 1)
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    rates, first = [], None
    for p in ids:
        req = eng.make_request(p, params)
        eng.add_request(req)
        while not req.finished:
            eng.step()
        first = first if first is not None else req.first_token_time - start
        rates.append((req.num_output - 1) / (req.finish_time - req.first_token_time))
    stats = eng.stats()
    return {"tok_s": statistics.median(rates), "ttfr_s": first, "verify8": verify_cost(eng),
            "accept": stats.get("avg_spec_accept_length"), "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "quantization": eng.args.quantization}


def chain_batch(eng, n: int, cached: int = 512):
    """A forward batch of one request's n-token chain after `cached` tokens (the padding row, whose
    slots read zeros): what a verify step (n > 1) or a plain step (n = 1) feeds the target."""
    import torch

    from engine.core.forward_batch import make_batch

    kv = eng.debug.kv
    return make_batch(kv.table, [kv.pad_row], [cached], torch.zeros(n, dtype=torch.long),
                      torch.full((n,), kv.pad_slot, dtype=torch.long), [n])


def verify_cost(eng) -> float:
    """An 8-token chain's forward over a 1-token forward, 512 cached tokens (the padding row), model
    alone: what a verify step costs against a plain step."""
    import torch

    def run(n: int) -> float:
        times = []
        with torch.inference_mode():
            for _ in range(12):
                batch = chain_batch(eng, n)
                t = time.perf_counter()
                eng.debug.target.forward(batch, all_logits=True, decode=True)     # as the worker runs both
                times.append(time.perf_counter() - t)
        return statistics.median(times[2:])

    return run(8) / run(1)


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    rows = [json.loads(line) for line in MT_BENCH.read_text().splitlines() if line.strip()]
    picks = [rows[(i * 10) % len(rows)]["turns"][0] for i in range(n)]       # one per category
    out = []
    for text in picks:
        if not getattr(tokenizer, "chat_template", None):      # a base model (Gemma-3-270M): the question as text
            out.append(tokenizer(text)["input_ids"])
            continue
        enc = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        out.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
    return out


def run_child(case: dict) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(case)]
    out = subprocess.run(cmd, cwd=HERE, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# ------------------------------------------------------------------ the comparison
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--eagle3", action="append", default=[], metavar="MODEL=DIR",
                    help="an EAGLE-3 head for a model, e.g. smollm2-135m=drafts/smollm2-eagle3")
    ap.add_argument("--head-quantization", help="also run each --eagle3 head in this weight format "
                    "(--speculative-draft-model-quantization, e.g. w4a8)")
    ap.add_argument("--eagle3-tree", action="append", default=[], metavar="STEPS,TOPK,TOKENS",
                    help="also run each --eagle3 head with this tree (repeatable; the auto tree always runs)")
    ap.add_argument("--quantization", default="auto", help="spec's --quantization (auto, int4, w8a8_int8, none)")
    ap.add_argument("--compile", action="store_true", help="spec with --enable-torch-compile")
    ap.add_argument("--llama-bin", type=Path, help="llama.cpp tools built elsewhere")
    ap.add_argument("--llama-cache", type=Path, default=Path.home() / ".cache" / "spec" / "llama.cpp")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        case = json.loads(a.child)
        print(json.dumps(spec_case(case["model"], case["spec"], case["prompts"], case["new_tokens"])))
        return
    from engine.loader import load_tokenizer, resolve_model_path
    from engine.loader.fetch import KNOWN_MODELS, models_dir

    bin_dir = a.llama_bin or build_llama_cpp(a.llama_cache)
    heads = dict(item.split("=", 1) for item in a.eagle3)
    print(f"# CPU flags: {cpu_flags()}; 2 threads; {a.prompts} prompts x {a.max_new_tokens} new tokens, "
          f"{a.rounds} rounds; spec --quantization {a.quantization}{' --enable-torch-compile' if a.compile else ''}")
    for model in a.models.split(","):
        gguf = models_dir() / model / KNOWN_MODELS[model].filename
        tok = load_tokenizer(resolve_model_path(model))
        prompts = chat_prompts(tok, a.prompts)
        texts = [tok.decode(p) for p in prompts]
        spec_cases = {"spec plain": {}, "spec NGRAM": {"speculative_algorithm": "NGRAM"}}
        if model in DRAFTS:
            spec_cases["spec STANDALONE"] = {"speculative_algorithm": "STANDALONE",
                                             "speculative_draft_model_path": DRAFTS[model]}
        for tree in [None] + a.eagle3_tree if model in heads else []:
            name, eagle3 = "spec EAGLE3", {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": heads[model]}
            if tree:
                steps, topk, tokens = map(int, tree.split(","))
                name += f" ({tree})"
                eagle3.update(speculative_num_steps=steps, speculative_eagle_topk=topk,
                              speculative_num_draft_tokens=tokens)
            spec_cases[name] = eagle3
            if a.head_quantization:
                spec_cases[f"{name}, {a.head_quantization} head"] = {
                    **eagle3, "speculative_draft_model_quantization": a.head_quantization}
        common = {"quantization": a.quantization, "enable_torch_compile": a.compile, "context_length": 4096}
        spec_cases = {name: {**common, **spec} for name, spec in spec_cases.items()}
        results: dict[str, list[dict]] = {}
        for _ in range(a.rounds):
            results.setdefault("llama.cpp plain", []).append(llama_plain(bin_dir, gguf, a.max_new_tokens))
            draft = models_dir() / DRAFTS[model] / KNOWN_MODELS[DRAFTS[model]].filename if model in DRAFTS else None
            name = "llama.cpp draft model" if draft else "llama.cpp n-gram cache"
            results.setdefault(name, []).extend(llama_speculative(bin_dir, gguf, t, a.max_new_tokens, draft)
                                                for t in texts)
            for name, spec in spec_cases.items():
                results.setdefault(name, []).append(run_child({"model": model, "spec": spec, "prompts": prompts,
                                                               "new_tokens": a.max_new_tokens}))
        base = statistics.median(r["tok_s"] for r in results["llama.cpp plain"])
        print(f"\n## {model} ({gguf.name})\n")
        print("| case | decode tok/s | vs llama.cpp plain | accept | verify-8 / 1-token | peak RSS GiB | first request s |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for name, runs in results.items():
            def med(key, fmt):
                values = [r[key] for r in runs if r.get(key) is not None]
                return fmt.format(statistics.median(values)) if values else "-"
            rate = statistics.median(r["tok_s"] for r in runs)
            accept = med("accept", "{:.2f}") if name.startswith("spec") else med("accept_pct", "{:.0f}% of drafts")
            print(f"| {name} | {rate:.1f} | {rate / base:.2f}x | {accept} | {med('verify8', '{:.2f}')} | "
                  f"{med('rss_gb', '{:.2f}')} | {med('ttfr_s', '{:.1f}')} |", flush=True)


if __name__ == "__main__":
    main()
