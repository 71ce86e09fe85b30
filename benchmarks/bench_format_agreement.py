"""How far each weight format's greedy answers follow the exact float32 reference (for choosing the
format EAGLE-3 training data is generated in: a head learns the argmax of the target that made it).

    python benchmarks/bench_format_agreement.py PATH.gguf

Greedy answers (64 tokens) to the first 16 MT-Bench first turns, 1 thread, from float32 (dense, dequantized), int4, dense
bfloat16 and w8a8_int8 engines; prints, for each, how many answers equal the reference and the mean
number of tokens before the first difference.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

MT_BENCH = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "mt_bench" / "question.jsonl"
FORMATS = (("float32", "none"), ("bfloat16", "int4"), ("bfloat16", "none"), ("bfloat16", "w8a8_int8"))
PROMPTS, MAX_NEW = 16, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    model = ap.parse_args().model
    torch.set_num_threads(1)
    from engine import Engine
    from spec_tools.convert.generate import chat_prompt_ids

    rows = [json.loads(line) for line in MT_BENCH.read_text().splitlines()[:PROMPTS]]
    answers = {}
    for dtype, quantization in FORMATS:
        engine = Engine(model_path=model, dtype=dtype, quantization=quantization, disable_radix_cache=True,
                        max_total_tokens=PROMPTS * (MAX_NEW + 640))
        ids = chat_prompt_ids(engine.tokenizer, [r["turns"][0] for r in rows])
        outs = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW})
        answers[dtype, quantization] = [o["output_ids"] for o in outs]
    reference = answers[FORMATS[0]]
    for fmt, got in answers.items():
        agree = [next((i for i, (x, y) in enumerate(zip(r, g)) if x != y), min(len(r), len(g)))
                 for r, g in zip(reference, got)]
        print(json.dumps({"dtype": fmt[0], "quantization": fmt[1], "identical": sum(r == g for r, g in zip(reference, got)),
                          "answers": PROMPTS, "mean_tokens_before_first_difference": round(sum(agree) / PROMPTS, 1)}))


if __name__ == "__main__":
    main()
