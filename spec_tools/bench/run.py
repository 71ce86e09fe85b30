"""`spec bench` end to end: load the prompts, set up the backends (in-process engine or server URLs), run
them (interleaved with a baseline when asked), and return every figure with the resolved configuration."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Protocol

from spec_tools.bench import BenchError
from spec_tools.bench.datasets import load_conversations
from spec_tools.bench.measure import run_session
from spec_tools.bench.options import BenchOptions
from spec_tools.bench.summary import compare, summarize
from engine.config import ServerArgs
from engine.core.sampling_params import SamplingParams

class Progress(Protocol):
    def phase(self, description: str, total: Optional[int] = None) -> None: ...

    def advance(self, description: str, steps: int = 1) -> None: ...


class Silent:
    def phase(self, description: str, total: Optional[int] = None) -> None:
        pass

    def advance(self, description: str, steps: int = 1) -> None:
        pass


def run_bench(args: ServerArgs, opts: BenchOptions, progress: Optional[Progress] = None) -> dict:
    opts.check()
    progress = progress or Silent()
    conversations = load_conversations(opts.dataset, opts.dataset_path, opts.num_prompts,
                                       input_len=opts.random_input_len, output_len=opts.random_output_len,
                                       seed=args.random_seed)
    compared = opts.compare_baseline or bool(opts.baseline_url) or opts.use_prediction
    if opts.use_prediction and not any(c.prediction for c in conversations):
        raise BenchError("--use-prediction needs prompts with predictions: --dataset code-edit, or a "
                         "--dataset-path question.jsonl whose rows carry a \"prediction\" string.")
    progress.phase("connecting" if opts.url else f"loading {args.model_path}")
    backends, config = _online(args, opts) if opts.url else _offline(args, opts, compared)
    progress.phase(backends[0].name, sum(len(c.turns) for c in conversations) * len(backends))
    session = run_session(backends, conversations, opts.max_concurrency,
                          lambda name, _turn: progress.advance(name))
    runs = [session.passes[b.name] for b in backends]
    result = {"mode": "online" if opts.url else "offline", "label": backends[0].name, **summarize(runs[0]),
              "baseline": None}
    if compared:
        result["baseline"] = summarize(runs[1])
        greedy = SamplingParams(temperature=opts.temperature).greedy
        result.update(compare(runs[0], runs[1], result, result["baseline"], greedy=greedy))
    result["config"] = {**config, "bench": dataclasses.asdict(opts)}
    return result


def _offline(args: ServerArgs, opts: BenchOptions, compared: bool):
    from spec_tools.bench.offline import OfflineBackend, plain_args
    from engine.engine import Engine

    if compared and not args.speculative_algorithm and not opts.use_prediction:
        raise BenchError("--compare-baseline compares speculative decoding with plain decoding: pass "
                         "--speculative-algorithm (and its draft model) too.")
    engine = Engine(server_args=args)
    resolved = engine.args
    config = {"server_args": resolved.to_dict(), "model_dir": str(engine.model_dir)}
    common = {"concurrency": opts.max_concurrency, "max_new_tokens": opts.max_new_tokens,
              "temperature": opts.temperature}
    if opts.use_prediction:         # the same configuration, with and without the predictions
        return [OfflineBackend(engine, "prediction", resolved, prediction=True, **common),
                OfflineBackend(engine, "baseline", resolved, **common)], config
    name = "spec" if args.speculative_algorithm else "plain"
    backends = [OfflineBackend(engine, name, resolved, **common)]
    if compared:
        backends.append(OfflineBackend(engine, "baseline", plain_args(resolved), **common))
    return backends, config


def _online(args: ServerArgs, opts: BenchOptions):
    from spec_tools.bench.online import OnlineBackend

    key = args.api_key or os.environ.get("SPEC_API_KEY")
    common = {"concurrency": opts.max_concurrency, "max_new_tokens": opts.max_new_tokens,
              "temperature": opts.temperature, "seed": args.random_seed, "api_key": key}
    main = OnlineBackend(opts.url, "prediction" if opts.use_prediction else "server", prediction=opts.use_prediction,
                         **common)
    backends = [main]
    if opts.use_prediction:
        backends.append(OnlineBackend(opts.url, "baseline", **common))
    config = {"url": main.url, "model": main.model, "server_info": _static_info(main.server_info)}
    if opts.baseline_url:
        base = OnlineBackend(opts.baseline_url, "baseline", **common)
        backends.append(base)
        config.update(baseline_url=base.url, baseline_server_info=_static_info(base.server_info))
    if main.server_info.get("speculative_algorithm") and not opts.use_prediction:
        main.name = "spec"
    return backends, config


def _static_info(info: dict) -> dict:
    """The server's configuration, without its live counters."""
    keep = {*ServerArgs.__dataclass_fields__, "model_path", "served_model_name"}
    return {k: v for k, v in info.items() if k in keep}
