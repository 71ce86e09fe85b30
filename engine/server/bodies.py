"""Large request bodies parsed and validated in child processes, so that the event loop keeps serving.

json.loads and pydantic's validation hold the GIL for the whole call, so on a thread they would stall
the event loop all the same. A child parses a body with the json module (FastAPI's parser: the same
bodies pass, the same errors come out), validates it with the route's model, and refuses a token-id
prompt that does not fit the context before anything comes back. A valid body comes back with its
token-id prompts packed as integer arrays, unpacked one prompt at a time on a thread: the event loop gets
its turns between prompts, where unpickling millions of Python ints in one call would hold it.

The children start with the first large body and import the request models (engine/server/protocol.py
and what it imports: keep torch and the engine out of it, or every child loads them too).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
from array import array
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Optional, Union

from pydantic import BaseModel, ValidationError

from engine.server.protocol import CompletionRequest, GenerateRequest

# Bodies up to this size are parsed on the event loop: quicker than a child's round trip.
SMALL_BYTES = 64 * 1024
# Children, each parsing one body at a time: a few large bodies at once go side by side. They run at a
# lower priority: on a machine short of cores, the event loop and the engine come first.
WORKERS, NICENESS = 2, 19
# The fields that hold token-id prompts, by request model.
PROMPT_IDS = {CompletionRequest: "prompt", GenerateRequest: "input_ids"}
TOO_DEEP = "The request body nests objects and arrays too deeply to parse; flatten it."


@dataclass
class Valid:
    """The validated body; its token-id prompts (if any) taken out of `model` and packed."""
    model: BaseModel
    field: Optional[str] = None
    packed: tuple[array, ...] = ()
    single: bool = False            # one prompt, not a list of them

    def unpack(self) -> BaseModel:
        if self.field is None:
            return self.model
        prompts = [ids.tolist() for ids in self.packed]
        return self.model.model_copy(update={self.field: prompts[0] if self.single else prompts})


@dataclass
class Invalid:
    """pydantic's errors (as FastAPI reports them: located in the body), inputs left out."""
    errors: list[dict]


@dataclass
class Refused:
    """A 400 for the client: message and error code."""
    message: str
    code: str


@dataclass
class Unreadable:
    """The body is no JSON text json.loads can read (not UTF-8, an integer past Python's digit limit)."""
    reason: str


Outcome = Union[Valid, Invalid, Refused, Unreadable]


def parse(body: bytes, model: type[BaseModel], context_len: int) -> Outcome:
    """In a child: the body parsed and validated with `model`, its token-id prompts checked against the context."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        return Invalid([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                         "ctx": {"error": exc.msg}}])
    except RecursionError:
        return Refused(TOO_DEEP, "invalid_json")
    except ValueError as exc:
        return Unreadable(str(exc))
    try:
        valid = model.model_validate(data, from_attributes=True)      # as FastAPI validates a body
    except ValidationError as exc:
        return Invalid([{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False, include_input=False)])
    field = PROMPT_IDS.get(model)
    value = getattr(valid, field) if field else None
    single = bool(value) and isinstance(value[0], int)
    prompts = [value] if single else value
    if not prompts or isinstance(prompts[0], str):
        return Valid(valid)
    too_long = next((len(p) for p in prompts if len(p) >= context_len), None)
    if too_long is not None:        # as serving.py would refuse it, once its ids had come back
        return Refused(f"The prompt has {too_long} tokens but the context length is {context_len}; shorten it.",
                       "context_length_exceeded")
    return Valid(valid.model_copy(update={field: None}), field, tuple(array("q", p) for p in prompts), single)


class BodyParser:
    """The children, started with the first large body. Used on the event loop."""

    def __init__(self, context_len: int):
        self.context_len = context_len
        self.work = parse               # what a child runs on a body
        self._pool: Optional[ProcessPoolExecutor] = None

    async def parse(self, body: bytes, model: type[BaseModel]) -> Outcome:
        if self._pool is None:
            # spawn: never fork a process that runs torch threads
            self._pool = ProcessPoolExecutor(WORKERS, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=os.nice, initargs=(NICENESS,))
        pool = self._pool
        try:
            outcome = await asyncio.wrap_future(pool.submit(self.work, body, model, self.context_len))
        except BrokenProcessPool:       # a child died (killed from outside): the next body gets new ones
            if self._pool is pool:
                self._pool = None
            raise
        if isinstance(outcome, Valid):
            return Valid(await asyncio.to_thread(outcome.unpack))
        return outcome

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
