"""Engine: the offline Python API, in the style of SGLang's `sglang.Engine`.

    from engine import Engine
    llm = Engine(model_path="smollm2-135m", speculative_algorithm="NGRAM")
    out = llm.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
    llm.shutdown()

`generate` takes one prompt or a list (or `input_ids`), returns one dict or a list of dicts with
`text`, `output_ids` and `meta_info`; `stream=True` yields cumulative updates as tokens arrive. The
engine steps its scheduler in the calling thread; the HTTP server drives the same `add_request` /
`step` API from its own loop. This class is the whole surface the server, `spec bench` / `spec tune`
and `spec convert` use: they never reach into the scheduler, worker or models. Tests and benchmarks
that must look inside read `Engine.debug` (an EngineView of the parts), never private attributes.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from engine.config import ServerArgs
from engine.distributed import group as tp_group
from engine.errors import ConfigError, RequestError
from engine.core.grammar import GrammarBackend
from engine.core.request import Request
from engine.core.sampling import choice_seed
from engine.speculative.prediction import Prediction
from engine.core.sampling_params import SamplingParams
from engine.text import hold_back_stop_prefix

log = logging.getLogger(__name__)

Prompt = Union[str, Sequence[str], None]


# Alternatives reported per output token at most (OpenAI's limit): each costs two floats per token in
# the step's host transfer.
MAX_TOP_LOGPROBS = 20

_SPECULATIVE_FIELDS = tuple(f.name for f in dataclasses.fields(ServerArgs) if f.name.startswith("speculative_"))


@dataclasses.dataclass(frozen=True)
class EngineView:
    """An engine's parts as they are now (Engine.debug), for tests and benchmarks that look inside: the
    target's model runner, the KV manager, the worker of the current speculative configuration and its
    planner. Reading is safe between steps; what changes them is the engine's own business."""
    target: Any                 # engine.core.model_runner.ModelRunner
    kv: Any                     # engine.memory.kv_manager.KVManager
    worker: Any                 # engine.core.worker.Worker
    planner: Any                # engine.speculative.planner.Planner

    @property
    def drafter(self):
        return self.worker.drafter


class Engine:
    def __init__(self, server_args: Optional[ServerArgs] = None, *, planner: Optional[Callable] = None,
                 **kwargs: Any):
        """`server_args`, or its fields as keywords. `planner` (an engine.speculative.planner.PlannerFactory)
        makes the planner of each speculative configuration; by default one whose step cost starts from
        forwards timed on this machine (engine.build.TimedPlanners). Tests give planners of fixed cost."""
        if server_args is not None and kwargs:
            raise TypeError("pass either server_args or keyword flags, not both")
        from engine.build import build_engine_parts
        from engine.distributed.launch import join

        args = server_args or ServerArgs.from_dict(kwargs)
        # Tensor parallelism (engine/distributed/): rank 0 leads, its machine's other ranks are started here.
        self._tp = join(args, Engine)
        try:
            with tp_group.sharded(self._tp is not None):
                parts = build_engine_parts(args, planner)
            if self._tp:
                self._tp.attach(parts.scheduler.worker)
                self._tp.started()
        except BaseException as exc:
            if self._tp:
                raise self._tp.start_failed(exc) from exc
            raise
        self.args = parts.args                  # resolved against the model: no "auto" left
        self.model_dir, self.model_config = parts.model_dir, parts.model_config
        self.tokenizer, self.eos_ids = parts.tokenizer, parts.eos_ids
        self._kv, self._target, self._scheduler = parts.kv, parts.target, parts.scheduler
        # Loaded draft models' drafters by what they draft with: a new tree shape reuses the weights.
        drafter = self._scheduler.worker.drafter
        self._drafters = {_draft_key(self.args): drafter} if _has_draft_model(self.args) else {}
        self._ids = itertools.count()
        self._seeds = itertools.count()
        self.grammars = GrammarBackend(self.tokenizer, self.model_config.vocab_size, self.eos_ids,
                                       enabled=self.args.grammar_backend != "none",
                                       any_whitespace=not self.args.constrained_json_disable_any_whitespace,
                                       compile_timeout=self.args.grammar_compile_timeout)

    # ------------------------------------------------------------------ figures
    @property
    def context_len(self) -> int:
        return self.args.context_length

    @property
    def kv_capacity(self) -> int:
        """KV slots in the pool: the most tokens all requests can hold at once."""
        return self._kv.capacity

    @property
    def has_work(self) -> bool:
        return self._scheduler.has_work

    @property
    def debug(self) -> EngineView:
        """The engine's parts, for tests and benchmarks (see EngineView); the server never reads them."""
        return EngineView(self._target, self._kv, self._scheduler.worker, self._scheduler.planner)

    def stats(self) -> dict:
        """Counters and gauges: steps, prefill and cached tokens, retractions, requests running and
        waiting, KV use, and speculative acceptance when speculation is on."""
        sched, kv = self._scheduler, self._kv
        cached = kv.cached()
        snap = {**sched.stats,
                "num_running_reqs": len(sched.requests) - len(sched.waiting),
                "num_waiting_reqs": len(sched.waiting),
                "kv_tokens_total": kv.capacity,
                "kv_tokens_cached": cached,
                "kv_tokens_used": kv.usage()[0] - cached}
        if sched.spec_stats is not None:
            snap.update(sched.spec_stats.summary())
        return snap

    # ------------------------------------------------------------------ reconfiguring, between requests
    def set_speculative(self, **changes: Any) -> None:
        """Switch speculative decoding (ServerArgs' speculative_* fields; speculative_algorithm=None is
        plain decoding) without reloading the target. A draft model already loaded for the same
        algorithm, draft and token map is reused with the new tree shape; an n-gram cache starts empty,
        and so does the prefix cache. Only between requests."""
        unknown = sorted(set(changes) - set(_SPECULATIVE_FIELDS))
        if unknown:
            raise ConfigError(f"set_speculative takes speculative_* options only; got {', '.join(unknown)}.")
        if changes.get("speculative_algorithm", self.args.speculative_algorithm) is None:
            changes = {**changes, "speculative_algorithm": None, "speculative_draft_model_path": None,
                       "speculative_num_steps": None, "speculative_eagle_topk": None,
                       "speculative_num_draft_tokens": None}
        if self.has_work:
            raise ConfigError("set_speculative runs between requests only; finish or abort the running ones first.")
        from engine.build import build_worker, resolve_args
        from engine.core.graph_runner import capture_shapes
        from engine.speculative.factory import unseeded_rule

        if self._tp:
            self._tp.set_speculative(changes)      # every rank loads the same draft
        device = self._kv.table.device.type
        args = resolve_args(dataclasses.replace(self.args, **changes), self.model_config, device)

        key = _draft_key(args)
        drafter = self._drafters.get(key)
        if drafter is not None:
            drafter.set_tree(args.speculative_tree, unseeded_rule(args))
            worker = build_worker(args, self._target, self._kv, self.eos_ids, drafter=drafter)
        else:
            if _has_draft_model(args):
                self._drafters = {}          # free the draft in use before loading another
            worker = build_worker(args, self._target, self._kv, self.eos_ids, self._load_draft(args))
            if _has_draft_model(args):
                self._drafters[key] = worker.drafter
        worker.capture = self._scheduler.worker.capture
        if self._tp:
            self._tp.attach(worker)
        # The new worker's step shapes are captured now, as at start-up: never while serving.
        capture_shapes(args, self._target, self._kv, worker.num_draft_tokens if _has_draft_model(args) else 1,
                       worker.capture_hidden)
        self._scheduler.set_worker(worker, args)
        self.args = args

    def _load_draft(self, args: ServerArgs):
        from engine.speculative.factory import load_draft_model

        model = self._target.model
        with tp_group.sharded(self._tp is not None):
            return load_draft_model(args, model, self.model_dir, next(model.parameters()).dtype,
                                    str(self._kv.table.device), args.max_positions)

    def capture_hidden_states(self, layers: Sequence[int]) -> None:
        """From now on every request keeps its positions' hidden states in `Request.captured`: the
        inputs of `layers` (Hugging Face's hidden_states indices) and the final normed state, with the
        argmax where logits were computed (training data for drafts). An empty sequence stops it."""
        self._scheduler.worker.capture = tuple(layers)

    def greedy_choices(self, token_ids: Sequence[int]):
        """The target's argmax after each prefix of token_ids (entry t follows token t), from one forward
        outside the scheduler, which must be idle: checks that stored answers are the target's."""
        import torch

        from engine.core.forward_batch import make_batch

        n = len(token_ids)
        if self.has_work or n > min(self._kv.unused(), self.context_len):
            raise RequestError(f"greedy_choices needs an idle engine and {n} free KV slots within the context")
        slots = self._kv.alloc(n)
        try:
            with torch.inference_mode():
                batch = make_batch(self._kv.table, [0], [0], token_ids, slots, [n])
                return self._target.forward(batch, all_logits=True).logits.argmax(-1).cpu()
        finally:
            self._kv.free(slots)

    # ------------------------------------------------------------------ low-level API
    def compile_grammar(self, params: SamplingParams, cancelled: Optional[Callable[[], bool]] = None):
        """The compiled grammar of the request's constraint, or None. Thread-safe (the server compiles
        off the engine thread); a RequestError naming the parameter when it is past the limits, does not
        compile or (with `cancelled`, in the compiler process) takes past --grammar-compile-timeout;
        engine.core.grammar_worker.CompileCancelled once cancelled() is true."""
        return self.grammars.compile(*params.constraint, cancelled=cancelled) if params.constraint else None

    def make_request(self, prompt_ids: Sequence[int], params: SamplingParams, rid: Optional[str] = None, *,
                     return_logprob: bool = False, top_logprobs_num: int = 0, grammar=None,
                     group: Optional[str] = None) -> Request:
        """Validate a tokenized request against this model and build its Request (not yet queued).
        `grammar`: compile_grammar's result, compiled here when not given; top_logprobs_num: alternatives
        reported per output token, with return_logprob; `group`: the client request it belongs to (the
        scheduler's unit of fair shares), by default its own."""
        if not prompt_ids:
            raise RequestError("The prompt is empty; pass some text or input_ids.")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"input_ids must be token ids in [0, {vocab}); got {bad[0]!r}.")
        bad = [t for t in params.logit_bias or {} if int(t) >= vocab]
        if bad:
            raise RequestError(f"logit_bias names token {bad[0]}, outside the vocabulary [0, {vocab}).", "logit_bias")
        bad = [t for t in params.reasoning_end or () if t >= vocab]
        if bad:
            raise RequestError(f"reasoning_end names token {bad[0]}, outside the vocabulary [0, {vocab}).",
                               "reasoning_end")
        if isinstance(top_logprobs_num, bool) or not isinstance(top_logprobs_num, int) or \
                not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs_num must be an integer in [0, {MAX_TOP_LOGPROBS}], got "
                               f"{top_logprobs_num!r}.", "top_logprobs_num")
        context = self.context_len
        if len(prompt_ids) >= context:
            raise RequestError(f"The prompt has {len(prompt_ids)} tokens but the context length is {context}; "
                               "shorten the prompt (or raise --context-length if the model allows).")
        # Alone in the KV pool a request may hold it all but one step's transient slots (a draft tree).
        tree = self._scheduler.worker.slots_per_request
        room = self.kv_capacity - tree
        if len(prompt_ids) >= room:
            full = min(len(prompt_ids) + params.max_new_tokens, context)
            raise RequestError(self._kv.budget.request_too_large(full, tree).replace(
                "out of KV cache: the request", f"The prompt ({len(prompt_ids)} tokens) cannot be served: it", 1))
        # What cannot fit is known now: max_new_tokens is clamped, and the answer ends with "length".
        params.max_new_tokens = min(params.max_new_tokens, context - len(prompt_ids), room - len(prompt_ids))
        seed = params.seed if params.seed is not None else self.args.random_seed * 1_000_003 + next(self._seeds)
        if grammar is None and params.constraint:
            grammar = self.compile_grammar(params)
        return Request(rid or f"req-{next(self._ids)}", list(prompt_ids), params, seed,
                       grammar=None if grammar is None else self.grammars.matcher(grammar, params.reasoning_end or ()),
                       return_logprob=return_logprob, top_logprobs_num=top_logprobs_num if return_logprob else 0,
                       prediction=self._prediction(params.prediction), group=group or "")

    def _prediction(self, prediction) -> Optional[Prediction]:
        """A request's Predicted Output as tokens (None without one)."""
        if prediction is None:
            return None
        ids = self.tokenizer.encode(prediction, add_special_tokens=False) if isinstance(prediction, str) else prediction
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in ids):
            raise RequestError(f"prediction holds token ids outside the vocabulary [0, {vocab}).", "prediction")
        if len(ids) > self.context_len:
            raise RequestError(f"The prediction has {len(ids)} tokens, more than the context length "
                               f"({self.context_len}); shorten it to the text the answer may repeat.", "prediction")
        return Prediction(ids)

    def make_choices(self, prompt_ids: Sequence[int], params: SamplingParams, rid: Optional[str] = None,
                     **options: Any) -> list[Request]:
        """One Request per choice (`params.n`), one group unless `options` names it; choice k of a seeded
        request samples with choice_seed(seed, k), a stream of its own.
        `options`: make_request's keyword arguments."""
        if params.constraint and options.get("grammar") is None:
            options["grammar"] = self.compile_grammar(params)           # once for all choices
        options.setdefault("group", rid or f"choices-{next(self._ids)}")
        return [self.make_request(prompt_ids, dataclasses.replace(params, seed=None if params.seed is None
                                                                  else choice_seed(params.seed, k)),
                                  rid=None if rid is None else f"{rid}-{k}", **options)
                for k in range(params.n)]

    def add_request(self, req: Request) -> None:
        self._scheduler.add(req)

    def step(self) -> list[Request]:
        """Run one step; return the requests that got tokens or finished."""
        return self._scheduler.step()

    def abort(self, rid: str, message: str = "aborted by the client", status_code: Optional[int] = None
              ) -> Optional[Request]:
        """End a request now; `status_code` says what kind of end it is (see FinishReason)."""
        return self._scheduler.abort(rid, message, status_code)

    # ------------------------------------------------------------------ SGLang-style API
    def generate(self, prompt: Prompt = None, sampling_params: Union[dict, Sequence[dict], None] = None,
                 input_ids: Union[Sequence[int], Sequence[Sequence[int]], None] = None, stream: bool = False,
                 return_logprob: bool = False, top_logprobs_num: int = 0):
        """return_logprob: meta_info gets output_token_logprobs [(logprob, id, None)] and
        output_top_logprobs (top_logprobs_num alternatives per token), as SGLang's."""
        requests, single = self._build_requests(prompt, sampling_params, input_ids,
                                                return_logprob=return_logprob, top_logprobs_num=top_logprobs_num)
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
                if id(req) in sent and (req.num_output != sent[id(req)] or req.finished):
                    sent[id(req)] = req.num_output
                    yield self.output_dict(req, index=requests.index(req))
            if all(r.finished for r in requests):
                return

    def _build_requests(self, prompt, sampling_params, input_ids, **options) -> tuple[list[Request], bool]:
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
        requests = [req for ids, params in zip(id_lists, param_list) for req in self.make_choices(ids, params, **options)]
        return requests, single and param_list[0].n == 1

    def output_dict(self, req: Request, index: Optional[int] = None) -> dict:
        meta = {
            "id": req.rid,
            "prompt_tokens": req.prompt_len,
            "completion_tokens": req.num_output,
            "cached_tokens": req.cached_tokens,
            "finish_reason": req.finish_reason.to_dict() if req.finish_reason else None,
            "e2e_latency": (req.finish_time or time.perf_counter()) - req.arrival,
            "ttft": None if req.first_token_time is None else req.first_token_time - req.arrival,
        }
        if self.args.speculative_algorithm:
            meta["spec_verify_ct"] = req.spec_verify_ct
            meta["spec_accept_token_num"] = req.spec_accepted_tokens        # SGLang's name
            meta["spec_accept_length"] = req.num_output / req.spec_verify_ct if req.spec_verify_ct else None
        if req.prediction is not None:
            meta["accepted_prediction_tokens"] = req.prediction.accepted
            meta["rejected_prediction_tokens"] = req.prediction.rejected
        if req.return_logprob:
            logprobs = req.output_logprobs[:req.num_output]
            meta["output_token_logprobs"] = [(lp, tok, None) for (lp, _), tok in zip(logprobs, req.output_ids)]
            meta["output_top_logprobs"] = [[(v, t, None) for t, v in top] for _, top in logprobs]
        text = req.text if req.finished else hold_back_stop_prefix(req.text, req.params.stop)
        out = {"text": text, "output_ids": req.output_ids, "meta_info": meta}
        if index is not None:
            out["index"] = index
        return out

    def get_server_info(self) -> dict:
        info = {"model_path": str(self.model_dir), **self.args.to_dict()}
        info.update(self._scheduler.stats)
        info["max_total_num_tokens"] = self.kv_capacity
        return info

    def abort_all(self) -> None:
        """Abort anything still queued or running and release its KV memory."""
        sched = self._scheduler
        for req in sched.requests:
            sched.abort(req.rid)
        sched.step()

    def shutdown(self) -> None:
        """abort_all, then stop the grammar compiler and the other tensor-parallel ranks: the engine is done."""
        self.abort_all()
        self.grammars.close()
        if self._tp:
            self._tp.stop()

    # ------------------------------------------------------------------ tensor parallelism
    def follow(self) -> None:
        """On a tensor-parallel rank other than 0 (engine/distributed/launch.py starts them): run the
        forwards rank 0 announces, until it stops."""
        self._tp.run(self)

    def on_rank_failure(self, callback) -> None:
        """Call callback(message), from another thread, when a tensor-parallel rank of this machine dies
        (the server stops then); never at --tp-size 1."""
        if self._tp:
            self._tp.ranks.on_death(callback)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _has_draft_model(args: ServerArgs) -> bool:
    return args.speculative_algorithm not in (None, "NGRAM")


def _draft_key(args: ServerArgs) -> tuple:
    """What a loaded drafter drafts with: another tree shape can reuse it, nothing else can."""
    # Multi-layer MTP drafting loads one layer per step.
    return (args.speculative_algorithm, args.speculative_draft_model_path, args.speculative_draft_model_revision,
            args.speculative_token_map, args.enable_multi_layer_eagle and args.speculative_num_steps)
