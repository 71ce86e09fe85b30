"""Engine: the offline Python API, in the style of SGLang's `sglang.Engine`.

    from engine import Engine
    llm = Engine(model_path="smollm2-135m", speculative_algorithm="NGRAM")
    out = llm.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
    llm.shutdown()

`generate` takes one prompt or a list (or `input_ids`), returns one dict or a list of dicts with
`text`, `output_ids` and `meta_info`; `stream=True` yields cumulative updates as tokens arrive. The
engine steps its scheduler in the calling thread; the HTTP server drives the same `add_request` /
`step` API from its own loop.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any, Iterator, Optional, Sequence, Union

from engine.config import ServerArgs
from engine.errors import RequestError
from engine.request import Request
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

Prompt = Union[str, Sequence[str], None]


class Engine:
    def __init__(self, server_args: Optional[ServerArgs] = None, **kwargs: Any):
        if server_args is not None and kwargs:
            raise TypeError("pass either server_args or keyword flags, not both")
        self.args = server_args or ServerArgs.from_dict(kwargs)
        from engine.build import build_engine_parts

        parts = build_engine_parts(self.args)
        self.model_dir, self.model_config = parts.model_dir, parts.model_config
        self.tokenizer, self.runner, self.scheduler = parts.tokenizer, parts.runner, parts.scheduler
        self.worker, self.eos_ids = parts.worker, parts.eos_ids
        self._ids = itertools.count()
        self._seeds = itertools.count()

    # ------------------------------------------------------------------ low-level API
    def make_request(self, prompt_ids: Sequence[int], params: SamplingParams, rid: Optional[str] = None) -> Request:
        """Validate a tokenized request against this model and build its Request (not yet queued)."""
        if not prompt_ids:
            raise RequestError("The prompt is empty; pass some text or input_ids.")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"input_ids must be token ids in [0, {vocab}); got {bad[0]!r}.")
        context = self.runner.context_len
        if len(prompt_ids) >= context:
            raise RequestError(f"The prompt has {len(prompt_ids)} tokens but the context length is {context}; "
                               "shorten the prompt (or raise --context-length if the model allows).")
        if params.max_new_tokens + len(prompt_ids) > context:
            params.max_new_tokens = context - len(prompt_ids)
        seed = params.seed if params.seed is not None else self.args.random_seed * 1_000_003 + next(self._seeds)
        return Request(rid or f"req-{next(self._ids)}", list(prompt_ids), params, seed)

    def make_choices(self, prompt_ids: Sequence[int], params: SamplingParams, rid: Optional[str] = None) -> list[Request]:
        """One Request per choice (`params.n`); choice k of a seeded request samples with seed + k."""
        return [self.make_request(prompt_ids, dataclasses.replace(params, seed=None if params.seed is None else params.seed + k),
                                  rid=None if rid is None else f"{rid}-{k}")
                for k in range(params.n)]

    def add_request(self, req: Request) -> None:
        self.scheduler.add(req)

    def step(self) -> list[Request]:
        return self.scheduler.step()

    def abort(self, rid: str) -> Optional[Request]:
        return self.scheduler.abort(rid)

    # ------------------------------------------------------------------ SGLang-style API
    def generate(self, prompt: Prompt = None, sampling_params: Union[dict, Sequence[dict], None] = None,
                 input_ids: Union[Sequence[int], Sequence[Sequence[int]], None] = None, stream: bool = False):
        requests, single = self._build_requests(prompt, sampling_params, input_ids)
        if stream:
            return self._stream(requests)
        for req in requests:
            self.add_request(req)
        while any(not r.finished for r in requests):
            self.step()
        outputs = [self.output_dict(r) for r in requests]
        return outputs[0] if single else outputs

    def _stream(self, requests: list[Request]) -> Iterator[dict]:
        for req in requests:
            self.add_request(req)
        sent = {id(r): -1 for r in requests}
        while True:
            for req in self.step() if any(not r.finished for r in requests) else []:
                if id(req) in sent and (len(req.output_ids) != sent[id(req)] or req.finished):
                    sent[id(req)] = len(req.output_ids)
                    yield self.output_dict(req, index=requests.index(req))
            if all(r.finished for r in requests):
                return

    def _build_requests(self, prompt, sampling_params, input_ids) -> tuple[list[Request], bool]:
        if (prompt is None) == (input_ids is None):
            raise RequestError("Pass exactly one of prompt (text) and input_ids.")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else list(prompt)
            if not all(isinstance(p, str) for p in prompts):
                raise RequestError("prompt must be a string or a list of strings.")
            id_lists = [self.tokenizer.encode(p) for p in prompts]
        else:
            single = not input_ids or not isinstance(input_ids[0], (list, tuple))
            id_lists = [list(input_ids)] if single else [list(x) for x in input_ids]
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(id_lists):
                raise RequestError(f"Got {len(sampling_params)} sampling_params for {len(id_lists)} prompts.")
            param_list = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            param_list = [SamplingParams.from_dict(sampling_params) for _ in id_lists]
        requests = [req for ids, params in zip(id_lists, param_list) for req in self.make_choices(ids, params)]
        return requests, single and param_list[0].n == 1

    def output_dict(self, req: Request, index: Optional[int] = None) -> dict:
        meta = {
            "id": req.rid,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_reason": req.finish_reason.to_dict() if req.finish_reason else None,
            "e2e_latency": (req.finish_time or time.perf_counter()) - req.arrival,
            "ttft": None if req.first_token_time is None else req.first_token_time - req.arrival,
        }
        if self.args.speculative_algorithm:
            meta["spec_verify_ct"] = req.spec_verify_ct
            meta["spec_accept_length"] = len(req.output_ids) / req.spec_verify_ct if req.spec_verify_ct else None
        text = req.text if req.finished else _hold_back_stop_prefix(req.text, req.params.stop)
        out = {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}
        if index is not None:
            out["index"] = index
        return out

    def get_server_info(self) -> dict:
        info = {"model_path": str(self.model_dir), **self.args.to_dict()}
        info.update(self.scheduler.stats)
        info["max_total_num_tokens"] = self.runner.allocator.size
        return info

    def shutdown(self) -> None:
        """Abort anything still queued or running and release the KV memory."""
        for req in list(self.scheduler.waiting) + list(self.scheduler.running):
            self.scheduler.abort(req.rid)
        self.scheduler.step()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _hold_back_stop_prefix(text: str, stops: Sequence[str]) -> str:
    """While a request runs, hide a tail that could be the start of a stop string (it may be cut)."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return text[:len(text) - hold] if hold else text
