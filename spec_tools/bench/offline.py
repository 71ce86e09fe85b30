"""Offline passes: conversations run in-process on an Engine, stepped from here.

Several decode configurations share one Engine (target weights, KV pool, scheduler, a loaded draft):
a pass first switches the engine to its configuration (plain, or speculative with its tree shape) with
Engine.set_speculative, which also empties the prefix cache, so no configuration reuses the prompts
another one prefilled.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

from spec_tools.bench import BenchError
from spec_tools.bench.datasets import Conversation
from spec_tools.bench.measure import OnTurn, PassResult, SpecCounts, TurnResult
from engine.config import ServerArgs
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams


def plain_args(args: ServerArgs) -> ServerArgs:
    return dataclasses.replace(args, speculative_algorithm=None, speculative_draft_model_path=None,
                               speculative_num_steps=None, speculative_eagle_topk=None,
                               speculative_num_draft_tokens=None)


def tree_args(args: ServerArgs, tree: tuple[int, int, int]) -> ServerArgs:
    """`args` with another tree shape (validated: ConfigError for an impossible one)."""
    steps, topk, tokens = tree
    return dataclasses.replace(args, speculative_num_steps=steps, speculative_eagle_topk=topk,
                               speculative_num_draft_tokens=tokens)


def speculative_options(args: ServerArgs) -> dict:
    """The speculative_* options of `args`, as Engine.set_speculative takes them."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name.startswith("speculative_")}


class ChatEncoder:
    """Messages to prompt token ids: the tokenizer's chat template when it has one, else the turns as text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))

    def encode(self, messages: list[dict]) -> list[int]:
        if self.templated:
            enc = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(enc["input_ids"] if hasattr(enc, "keys") else enc)
        return self.tokenizer.encode("\n\n".join(m["content"] for m in messages) + "\n\n")


def sampling_for(conv: Conversation, turn: int, max_new_tokens: int, temperature: float, seed: int,
                 prediction: bool = False) -> dict:
    """The same sampling parameters, seed included, for a turn whatever the backend or configuration;
    with `prediction`, the conversation's Predicted Output on its first turn."""
    fixed = conv.max_new_tokens is not None
    params = {"max_new_tokens": conv.max_new_tokens if fixed else max_new_tokens, "temperature": temperature,
              "ignore_eos": fixed, "seed": seed * 1_000_003 + conv.index * 16 + turn}
    if prediction and turn == 0 and conv.prediction is not None:
        params["prediction"] = conv.prediction
    return params


@dataclass
class _Live:
    conv: Conversation
    turn: int
    messages: list[dict]
    seen: int = 0
    last: float = 0.0
    gaps: list[float] = field(default_factory=list)


class OfflineBackend:
    def __init__(self, engine, name: str, args: ServerArgs, *, concurrency: int, max_new_tokens: int,
                 temperature: float, prediction: bool = False):
        self.engine, self.name, self.args = engine, name, args
        self.concurrency, self.prediction = concurrency, prediction
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.chat = ChatEncoder(engine.tokenizer)

    def _counts(self) -> Optional[SpecCounts]:
        return SpecCounts.from_server_info(self.engine.stats()) if self.args.speculative_algorithm else None

    def run(self, conversations: Sequence[Conversation], on_turn: OnTurn) -> PassResult:
        engine = self.engine
        engine.set_speculative(**speculative_options(self.args))
        before = self._counts()
        pending, live, results = deque(conversations), {}, []
        decode_steps, decode_time = engine.stats()["decode_steps"], 0.0

        def start(conv: Conversation, turn: int, history: list[dict]) -> None:
            messages = history + [{"role": "user", "content": conv.turns[turn]}]
            params = sampling_for(conv, turn, self.max_new_tokens, self.temperature, self.args.random_seed,
                                  self.prediction)
            req = engine.make_request(self.chat.encode(messages), SamplingParams.from_dict(params))
            engine.add_request(req)
            live[req] = _Live(conv, turn, messages, last=req.arrival)

        t0 = time.perf_counter()
        while pending or live:
            while pending and len(live) < self.concurrency:
                start(pending.popleft(), 0, [])
            steps = engine.stats()["decode_steps"]
            t = time.perf_counter()
            touched = engine.step()
            now = time.perf_counter()
            if engine.stats()["decode_steps"] > steps:
                decode_time += now - t
            for req in touched:
                state = live.get(req)
                if state is None:
                    continue
                if req.num_output > state.seen:
                    if state.seen:
                        state.gaps.append(now - state.last)
                    state.seen, state.last = req.num_output, now
                if req.finished:
                    del live[req]
                    results.append(self._result(req, state))
                    on_turn(self.name, results[-1])
                    if state.turn + 1 < len(state.conv.turns):
                        start(state.conv, state.turn + 1, state.messages + [{"role": "assistant", "content": req.text}])
        duration = time.perf_counter() - t0
        after = self._counts()
        return PassResult(results, duration, engine.stats()["decode_steps"] - decode_steps, decode_time,
                          after - before if after is not None else None)

    def _result(self, req: Request, state: _Live) -> TurnResult:
        reason = req.finish_reason
        if reason is not None and reason.type == "abort":
            raise BenchError(f"Request {state.conv.id} (turn {state.turn + 1}) was aborted: {reason.message}.")
        spec = self.args.speculative_algorithm is not None
        predicted = req.prediction
        return TurnResult(state.conv.id, state.conv.category, state.turn, req.prompt_len, req.num_output,
                          None if req.first_token_time is None else req.first_token_time - req.arrival,
                          req.finish_time - req.arrival, state.gaps, req.output_ids,
                          req.spec_verify_ct if spec else None, req.spec_accepted_tokens if spec else None,
                          predicted and (predicted.accepted, predicted.rejected))
