"""Answer tokens/s of EAGLE-3 training-data generation (`spec convert train-eagle3`'s data phase).

    PYTHONPATH=CHECKOUT python benchmarks/bench_eagle3_data.py --model PATH.gguf [-n 64] [--gen-batch 64]
        [--max-new-tokens 128] [--dtype auto] [--quantization auto] [--threads 2]

The target answers the first -n prompts of GSM8K's train questions (greedy, chat template) while the
engine captures the three auxiliary and the final hidden states, exactly as the data phase does
(generation_engine, generate_groups, take_sample; writing the shards is left out). Prints one JSON
line: answer tokens, seconds (engine start-up excluded) and answer tokens/s. It uses only what both
the old and the new checkout have, so PYTHONPATH picks which one is measured: run them interleaved.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "gsm8k" / "question.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--gen-batch", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, help="passed on only when given (the old checkout lacks it)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cpu", action="store_true", help="print the CPU model and flags first")
    a = ap.parse_args()
    if a.cpu:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
        print("\n".join(line for line in lscpu if line.startswith(("Model name", "CPU(s)", "Flags"))))
    if a.threads:
        torch.set_num_threads(a.threads)

    import engine
    from spec_tools.convert.eagle3_data import take_sample
    from spec_tools.convert.generate import Generation, chat_prompt_ids, generate_groups, generation_engine
    from engine.core.model_runner import resolve_dtype, resolve_quantization
    from engine.models.eagle import eagle3_aux_layers

    extra = {"quantization": a.quantization} if a.quantization else {}
    eng = generation_engine(a.model, a.gen_batch, a.max_new_tokens, a.dtype, "cpu", **extra)
    eng.capture_hidden_states(eagle3_aux_layers(object(), eng.model_config.num_hidden_layers, a.model))
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:a.n]]
    ids = chat_prompt_ids(eng.tokenizer, [r["turns"][0] for r in rows])
    gen = Generation(max_new_tokens=a.max_new_tokens)
    started = time.perf_counter()
    tokens = samples = 0
    for reqs in generate_groups(eng, ids, gen, 4 * a.gen_batch):
        tokens += sum(r.num_output for r in reqs)
        samples += sum(take_sample(r) is not None for r in reqs)
    took = time.perf_counter() - started
    try:        # the new checkout resolves the generating target's format itself
        from spec_tools.convert.generate import generation_format
    except ImportError:  # the old one generated as spec serve resolves it
        def generation_format(model_dir, config, quantization, dtype, device):
            quant = resolve_quantization(quantization, model_dir, device, dtype, config)
            return str(resolve_dtype(dtype, config, device, quantized=quant is not None)), quant
    dtype, quant = generation_format(eng.model_dir, eng.model_config, a.quantization or "auto", a.dtype, "cpu")
    print(json.dumps({"checkout": str(Path(engine.__file__).parents[1]), "dtype": dtype.removeprefix("torch."),
                      "quantization": quant or "none", "gen_batch": a.gen_batch, "prompts": a.n,
                      "samples": samples, "answer_tokens": tokens, "seconds": round(took, 1),
                      "tok_s": round(tokens / took, 1)}))


if __name__ == "__main__":
    main()
