"""The target's own answers to a prompt set: what a draft sees when it serves (on-policy data).

Prompts go through the chat template exactly as `spec bench` sends them; requests run in groups through
the Engine's scheduler (batched decoding, chunked prefill), each group handed back when all its
requests have finished, so callers can write results as they come and resume after an interruption.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

from engine.request import Request
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Generation:
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    top_p: float = 1.0


def generation_engine(model: str, batch: int, max_new_tokens: int, dtype: str, device: str,
                      quantization: str = "auto"):
    """An Engine for answering prompt sets: `batch` requests at a time in a KV pool sized for them
    (prompts up to 512 tokens), radix cache off so that every position is computed (and captured).
    `quantization` as `spec serve --quantization`."""
    from engine import Engine

    return Engine(model_path=model, dtype=dtype, device=device, quantization=quantization, disable_radix_cache=True,
                  max_running_requests=batch, max_total_tokens=batch * (max_new_tokens + 512))


def chat_prompt_ids(tokenizer, prompts: Sequence[str]) -> list[list[int]]:
    from engine.bench.offline import ChatEncoder

    encoder = ChatEncoder(tokenizer)
    return [encoder.encode([{"role": "user", "content": p}]) for p in prompts]


def generate_groups(engine, prompt_ids: Sequence[Sequence[int]], gen: Generation, group: int, *,
                    first_index: int = 0, on_step: Optional[Callable[[int, int], None]] = None) -> Iterator[list[Request]]:
    """Finished requests, `group` prompts at a time, in prompt order. Prompt i (counting from
    `first_index`, so that a resumed run samples as the first one did) gets seed gen.seed + i.
    on_step(new tokens, newly finished prompts) is told after every engine step."""
    context = engine.context_len
    for start in range(0, len(prompt_ids), group):
        reqs = []
        for i, ids in enumerate(prompt_ids[start:start + group], first_index + start):
            ids = list(ids)[-(context - 2):]         # a prompt longer than the context keeps its end
            params = SamplingParams.from_dict({"max_new_tokens": gen.max_new_tokens, "temperature": gen.temperature,
                                               "top_p": gen.top_p, "seed": gen.seed + i})
            reqs.append(engine.make_request(ids, params))
        for req in reqs:
            engine.add_request(req)
        produced = finished = 0
        while finished < len(reqs):
            engine.step()
            now, done = sum(r.num_output for r in reqs), sum(r.finished for r in reqs)
            if on_step and (now, done) != (produced, finished):
                on_step(now - produced, done - finished)
            produced, finished = now, done
        yield reqs
