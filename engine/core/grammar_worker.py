"""Grammar compilation in a child process, so that a compile can be cut short: xgrammar's compile
cannot be interrupted on a thread, and a schema within the size limits may still take long. The server
compiles here (engine/core/grammar.py sends it); past `--grammar-compile-timeout`, or once the request's
client has gone, the child is killed, and the next compile starts a new one.

The child holds an xgrammar compiler for the model's tokenizer (sent once, serialized) and answers
one constraint at a time with the compiled grammar, serialized; it imports neither torch nor the
engine, so it starts in about a second.
"""

from __future__ import annotations

import multiprocessing
import re
import threading
import time
from typing import Callable

from engine.errors import RequestError

# How often a waiting compile checks its time limit and its client.
POLL_S = 0.05
# How much of a compiler error to quote back to the client.
_MAX_ERROR_CHARS = 400
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class CompileCancelled(Exception):
    """The request's client went away while its grammar compiled."""


def compile_constraint(compiler, kind: str, text: str, any_whitespace: bool):
    """xgrammar's compiled grammar of a constraint (kind: a SamplingParams.CONSTRAINTS name); a
    RequestError naming `kind` when it does not compile."""
    try:
        if kind == "json_schema":
            # xgrammar's strict mode (SGLang's default too): no properties or items beyond those the
            # schema lists, which is what OpenAI's strict structured outputs promise.
            return compiler.compile_json_schema(text, any_whitespace=any_whitespace)
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "ebnf":
            return compiler.compile_grammar(text)
        if kind == "structural_tag":
            return compiler.compile_structural_tag(text)
    except Exception as exc:      # xgrammar raises RuntimeError, ValueError or its own JSON errors
        message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        message = _LOCATION.sub("", message)       # "[12:00:00] /project/cpp/file.cc:123: " says nothing to a client
        raise RequestError(f"{kind} could not be compiled: {message[:_MAX_ERROR_CHARS]}", kind) from None
    raise AssertionError(kind)


class CompileWorker:
    """The child process and the one compile it runs at a time. Thread-safe."""

    def __init__(self, tokenizer_info, any_whitespace: bool):
        self._info, self._any_whitespace = tokenizer_info, any_whitespace
        self._info_json = None          # the vocabulary as the child receives it, serialized once
        self._lock = threading.Lock()
        self._proc = self._conn = None
        self.cut_short = 0              # compiles killed (time limit or client gone): tests read it

    def compile(self, kind: str, text: str, timeout: float, cancelled: Callable[[], bool]):
        """The compiled grammar; RequestError when it does not compile or takes longer than `timeout`
        seconds, CompileCancelled once cancelled() is true (while waiting for the child, or in it)."""
        while not self._lock.acquire(timeout=POLL_S):
            if cancelled():
                raise CompileCancelled()
        try:
            status, payload = self._run(kind, text, timeout, cancelled)
        finally:
            self._lock.release()
        if status == "error":
            raise RequestError(payload, kind)
        import xgrammar as xgr

        return xgr.CompiledGrammar.deserialize_json(payload, self._info)

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _run(self, kind: str, text: str, timeout: float, cancelled: Callable[[], bool]) -> tuple[str, str]:
        if self._proc is None or not self._proc.is_alive():
            self._start()
        self._conn.send((kind, text))
        deadline = time.monotonic() + timeout
        while not self._conn.poll(POLL_S):
            if cancelled():
                self._cut_short()
                raise CompileCancelled()
            if time.monotonic() > deadline:
                self._cut_short()
                raise RequestError(f"{kind} did not compile within {timeout:g} s (--grammar-compile-timeout); "
                                   "simplify it (fewer nested or alternative parts).", kind)
            if not self._proc.is_alive():
                self._kill()
                raise RequestError(f"{kind} could not be compiled: the compiler process ended (out of memory?); "
                                   "simplify it.", kind)
        return self._conn.recv()

    def _start(self) -> None:
        if self._info_json is None:
            self._info_json = self._info.serialize_json()
        context = multiprocessing.get_context("spawn")      # never fork a process that runs torch threads
        self._conn, child = context.Pipe()
        self._proc = context.Process(target=_serve, args=(child, self._info_json, self._any_whitespace),
                                     name="spec-grammar-compiler", daemon=True)
        self._proc.start()
        child.close()

    def _cut_short(self) -> None:
        self.cut_short += 1
        self._kill()

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
            self._conn.close()
        self._proc = self._conn = None


def _serve(conn, info_json: str, any_whitespace: bool) -> None:
    """The child: compile each constraint received, answer ("ok", serialized) or ("error", message)."""
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info_json), cache_enabled=False)
    while True:
        try:
            kind, text = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", compile_constraint(compiler, kind, text, any_whitespace).serialize_json()))
        except RequestError as exc:
            conn.send(("error", str(exc)))
