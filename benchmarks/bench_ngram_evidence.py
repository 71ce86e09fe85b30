"""How well an NGRAM match's length foretells its draft's acceptance: the evidence by which
--speculative-adaptive sizes NGRAM's drafts (engine/speculative/sizing.py, Drafter.evidence).

    M=~/.cache/spec-models
    python benchmarks/bench_ngram_evidence.py --model $M/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf \\
        [--prompts 12] [--seed 6] [--max-new-tokens 128]

Chat prompts as bench_served_load.py draws them (MT-Bench first turns and GSM8K questions), one at a
time, greedy, the whole tree verified every step (--speculative-adaptive off, so that every match is
tried). Per match length (the longest context of the request's text seen followed by something, read
before each draft): drafts made, the share whose first token was accepted, and draft tokens accepted
on average out of the tree's.
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE / "benchmarks"))
from bench_llamacpp import cpu_flags  # noqa: E402
from bench_served_load import prompt_pool  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file or model directory")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--seed", type=int, default=6, help="the prompt draw")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from engine import Engine
    from spec_tools.bench.offline import ChatEncoder

    eng = Engine(model_path=args.model, num_threads=args.threads, log_level="warning",
                 speculative_algorithm="NGRAM", speculative_adaptive="off")
    drafter, worker = eng.debug.drafter, eng.debug.worker
    forward = worker.forward
    drafts = defaultdict(lambda: [0, 0, 0])         # match length -> [drafts, first accepted, accepted]

    def recording(step):
        evidence = [drafter.evidence(r) for r in step.reqs] if hasattr(step, "drafts") else None
        result = forward(step)
        for key, proposed, accepted in zip(evidence or (), result.proposed or (), result.drafts or ()):
            if proposed:
                row = drafts[key]
                row[0], row[1], row[2] = row[0] + 1, row[1] + (accepted > 0), row[2] + accepted
        return result

    worker.forward = recording
    chat = ChatEncoder(eng.tokenizer)
    for prompt in prompt_pool(args.seed)[:args.prompts]:
        eng.generate(input_ids=chat.encode([{"role": "user", "content": prompt}]),
                     sampling_params={"temperature": 0, "max_new_tokens": args.max_new_tokens})
    eng.shutdown()

    print(f"# {Path(args.model).name}, {args.prompts} prompts (seed {args.seed}), {args.max_new_tokens} new tokens, "
          f"greedy, {worker.num_draft_tokens - 1} draft tokens a step")
    print(f"# {platform.processor() or platform.machine()}; CPU flags: {cpu_flags()}\n")
    print("| match length | drafts | first token accepted | draft tokens accepted (mean) |")
    print("| --- | --- | --- | --- |")
    for key in sorted(drafts):
        n, first, accepted = drafts[key]
        print(f"| {key} | {n} | {first / n:.0%} | {accepted / n:.2f} |")


if __name__ == "__main__":
    main()
