"""The target's own answers to a prompt set: what a draft sees when it serves (on-policy data).

Prompts go through the chat template exactly as `spec bench` sends them; requests run in groups through
the Engine's scheduler (batched decoding, chunked prefill), each group handed back when all its
requests have finished, so callers can write results as they come and resume after an interruption;
the next group is already queued then, so the batch never drains at a group's end.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Callable, Iterator, Optional, Sequence

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class Generation:
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    top_p: float = 1.0


def generation_format(model_dir, config, quantization: str, dtype: str, device: str) -> tuple[str, str]:
    """(dtype, weight format) the target answers in, resolved as spec serve resolves its --dtype and
    --quantization: by default the data comes from the target as it is served, whose argmax is what a
    head must predict (a 4-bit GGUF on a CPU: int4; docs/convert.md measures the alternatives)."""
    from engine.core.model_runner import resolve_dtype, resolve_quantization

    quantized = resolve_quantization(quantization, model_dir, device, dtype, config)
    resolved = resolve_dtype(dtype, config, device, quantized=quantized is not None)
    return str(resolved).removeprefix("torch."), quantized or "none"


def generation_engine(model: str, batch: int, max_new_tokens: int, dtype: str, device: str,
                      quantization: str = "auto"):
    """An Engine for answering prompt sets: `batch` requests at a time in a KV pool sized for them
    (prompts up to 512 tokens), radix cache off so that every position is computed (and captured),
    the target in generation_format's dtype and weight format."""
    from engine import Engine
    from engine.loader import load_config, resolve_model_path
    from engine.core.model_runner import resolve_device

    model_dir = resolve_model_path(model)
    dtype, quantization = generation_format(model_dir, load_config(model_dir), quantization, dtype,
                                            resolve_device(device))
    return Engine(model_path=str(model_dir), dtype=dtype, device=device, quantization=quantization,
                  disable_radix_cache=True, max_running_requests=batch,
                  max_total_tokens=batch * (max_new_tokens + 512))


def chat_prompt_ids(tokenizer, prompts: Sequence[str]) -> list[list[int]]:
    from spec_tools.bench.offline import ChatEncoder

    encoder = ChatEncoder(tokenizer)
    return [encoder.encode([{"role": "user", "content": p}]) for p in prompts]


def generate_groups(engine, prompt_ids: Sequence[Sequence[int]], gen: Generation, group: int, *,
                    first_index: int = 0, on_step: Optional[Callable[[int, int], None]] = None) -> Iterator[list[Request]]:
    """Finished requests, `group` prompts at a time, in prompt order. Prompt i (counting from
    `first_index`, so that a resumed run samples as the first one did) gets seed gen.seed + i.
    The next group waits queued behind the one being answered, so the batch stays full across a
    group's end instead of draining to its longest answer. on_step(new tokens, newly finished
    prompts) is told after every engine step."""
    starts = iter(range(0, len(prompt_ids), group))
    pending = deque(_submit(engine, prompt_ids, gen, start, group, first_index) for start in islice(starts, 2))
    produced = finished = retired_tokens = retired_done = 0
    while pending:
        engine.step()
        live = [r for reqs in pending for r in reqs]
        now = retired_tokens + sum(r.num_output for r in live)
        done = retired_done + sum(r.finished for r in live)
        if on_step and (now, done) != (produced, finished):
            on_step(now - produced, done - finished)
        produced, finished = now, done
        while pending and all(r.finished for r in pending[0]):
            reqs = pending.popleft()
            retired_tokens, retired_done = retired_tokens + sum(r.num_output for r in reqs), retired_done + len(reqs)
            yield reqs
            start = next(starts, None)
            if start is not None:
                pending.append(_submit(engine, prompt_ids, gen, start, group, first_index))


def _submit(engine, prompt_ids, gen: Generation, start: int, group: int, first_index: int) -> list[Request]:
    reqs = []
    for i, ids in enumerate(prompt_ids[start:start + group], first_index + start):
        ids = list(ids)[-(engine.context_len - 2):]          # a prompt longer than the context keeps its end
        params = SamplingParams.from_dict({"max_new_tokens": gen.max_new_tokens, "temperature": gen.temperature,
                                           "top_p": gen.top_p, "seed": gen.seed + i})
        reqs.append(engine.make_request(ids, params))
    for req in reqs:
        engine.add_request(req)
    return reqs
