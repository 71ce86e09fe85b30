"""`spec tune`: the fastest speculative tree shape (steps, topk, draft tokens) per batch size.

One Engine serves every candidate: the target and draft weights, KV pool and scheduler stay loaded,
and each evaluation switches the engine to its tree (Engine.set_speculative), so N candidates cost one
load, not N server starts.

Successive halving, per batch size: round r runs the surviving candidates on the next n0 * 2^r prompts,
the same prompts for each, then keeps the faster half by output tokens/s over all rounds so far. The
no-speculation baseline runs every round and never drops out: each speedup is measured against it on
the same prompts. With K candidates that is ceil(log2 K) rounds, fewer when the prompts cannot fill
them with at least one batch in the first (then each cut keeps a smaller share, so that about two
candidates reach the last round); the finalists run on about --num-prompts prompts, a candidate cut
after the first round on a 1/(2^rounds - 1) share of them.

A round is interleaved: its prompts are split into up to 4 chunks (a batch at least, see measure.py),
and every candidate runs chunk 1, then every candidate chunk 2, in reversed order on every other chunk.
So each candidate's time is spread over the whole round, and a machine getting busier or quieter
meanwhile slows or speeds all alike instead of favouring whoever ran last. --time-budget is checked
between chunks (shared evenly by the batch sizes still to search): all candidates of a round always
have run the same prompts, and when time runs out they are ranked on what they ran so far.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from spec_tools.bench import BenchError
from spec_tools.bench.datasets import Conversation, load_conversations
from spec_tools.bench.measure import PassResult, interleave_chunks, merge, warm_up
from spec_tools.bench.options import TuneOptions
from spec_tools.bench.run import Progress, Silent
from engine.config import ServerArgs
from engine.errors import ConfigError

Tree = tuple[int, int, int]
BASELINE = "baseline"


def label(tree: Optional[Tree]) -> str:
    return BASELINE if tree is None else "{}x{}x{}".format(*tree)


def search_space(args: ServerArgs, steps: Sequence[int], topks: Sequence[int],
                 draft_tokens: Sequence[int]) -> tuple[list[Tree], list[dict]]:
    """Valid trees in grid order, and the impossible combinations with ServerArgs' reason. A chain
    (topk 1) always verifies steps + 1 tokens, so for it the draft-token values are not crossed."""
    from spec_tools.bench.offline import tree_args

    trees: list[Tree] = []
    skipped: list[dict] = []
    for s in dict.fromkeys(steps):
        for k in dict.fromkeys(topks):
            for d in ([s + 1] if k == 1 else dict.fromkeys(draft_tokens)):
                try:
                    tree_args(args, (s, k, d))
                except ConfigError as exc:
                    skipped.append({"tree": [s, k, d], "reason": str(exc)})
                    continue
                trees.append((s, k, d))
    return trees, skipped


# ------------------------------------------------------------------ the search, independent of the engine
@dataclass
class Halving:
    records: dict[Optional[Tree], list[PassResult]]    # per candidate, one merged pass per round it ran
    dropped: dict[Tree, int] = field(default_factory=dict)   # candidate -> round after which it was dropped
    finalists: list[Optional[Tree]] = field(default_factory=list)
    best: Optional[Tree] = None                        # None: the baseline
    out_of_time: bool = False


def tokens_per_s(passes: Sequence[PassResult]) -> float:
    duration = sum(p.duration for p in passes)
    return sum(t.completion_tokens for p in passes for t in p.turns) / duration if duration > 0 else 0.0


@dataclass(frozen=True)
class Plan:
    """Rounds of a search: round r runs `first * 2**r` prompts; each pruning keeps ceil(n / eta)."""
    rounds: int
    first: int
    eta: float
    batch_size: int = 1

    @classmethod
    def make(cls, candidates: int, prompts: int, batch_size: int) -> "Plan":
        # As many rounds as halving needs, but no more than fit in the prompts with a full batch first.
        rounds = max(1, min(math.ceil(math.log2(max(candidates, 1))), int(math.log2(prompts / batch_size + 1))))
        first = max(batch_size, prompts // (2 ** rounds - 1))
        # Prune fast enough that about two candidates reach the last round.
        eta = max(2.0, (candidates / 2) ** (1 / (rounds - 1))) if rounds > 1 else 2.0
        return cls(rounds, first, eta, batch_size)

    def keep(self, n: int) -> int:
        return max(1, math.ceil(n / self.eta))

    def round_prompts(self, r: int) -> int:
        return self.first * 2 ** r

    def evaluations(self, candidates: int) -> int:
        """Evaluations (one candidate on one chunk) without a time limit, the baseline's included."""
        total = 0
        for r in range(self.rounds):
            total += (candidates + 1) * len(interleave_chunks(range(self.round_prompts(r)), self.batch_size))
            candidates = self.keep(candidates)
        return total


def successive_halving(trees: Sequence[Tree], prompts: Sequence[Conversation], plan: Plan,
                       evaluate: Callable[[Optional[Tree], list[Conversation], int], PassResult],
                       deadline: float, clock: Callable[[], float] = time.monotonic) -> Halving:
    """`evaluate(tree or None for the baseline, prompts, round)`; see the module docstring."""
    result = Halving({None: [], **{t: [] for t in trees}})
    survivors = list(trees)
    offset = flips = 0
    for r in range(plan.rounds):
        size = plan.round_prompts(r)
        part = [prompts[(offset + i) % len(prompts)] for i in range(size)]
        offset += size
        order = [None, *survivors]
        ran: dict[Optional[Tree], list[PassResult]] = {c: [] for c in order}
        for j, chunk in enumerate(interleave_chunks(part, plan.batch_size)):
            if (r or j) and clock() >= deadline:     # the first chunk always runs: something to rank
                result.out_of_time = True
                break
            for cand in (order if flips % 2 == 0 else order[::-1]):
                ran[cand].append(evaluate(cand, chunk, r))
            flips += 1
        for cand, passes in ran.items():
            if passes:
                result.records[cand].append(merge(passes))
        if result.out_of_time:
            break
        if r < plan.rounds - 1:
            ranked = sorted(survivors, key=lambda t: tokens_per_s(result.records[t]), reverse=True)
            survivors = ranked[:plan.keep(len(ranked))]
            result.dropped.update({t: r for t in ranked[len(survivors):]})
    result.finalists = [None, *survivors]
    result.best = max(result.finalists, key=lambda c: tokens_per_s(result.records[c]))
    return result


def describe(halving: Halving) -> list[dict]:
    """One row per candidate: figures over every round it ran, speedup against the baseline's same rounds."""
    base = halving.records[None]
    rows = []
    for cand, passes in halving.records.items():
        run = merge(passes)
        if cand == halving.best:
            status = "best"
        elif cand is None:
            status = BASELINE
        elif cand in halving.dropped:
            status = f"cut (round {halving.dropped[cand] + 1})"
        else:
            status = "finalist"
        base_tps = tokens_per_s(base[:len(passes)])
        rows.append({
            "label": label(cand), "tree": list(cand) if cand else None, "status": status, "rounds": len(passes),
            "prompts": sum(t.turn == 0 for t in run.turns),
            "completion_tokens": sum(t.completion_tokens for t in run.turns),
            "duration_s": run.duration,
            "output_tokens_per_s": tokens_per_s(passes),
            "accept_length": run.spec.accept_length if run.spec else None,
            "step_time_ms": 1000 * run.decode_time / run.decode_steps if run.decode_steps else None,
            "speedup": tokens_per_s(passes) / base_tps if base_tps > 0 else None,
        })
    rows.sort(key=lambda r: (-r["rounds"], -r["output_tokens_per_s"]))
    return rows


# ------------------------------------------------------------------ the saved config
def serve_config(user_args: ServerArgs, tree: Optional[Tree], batch_size: int) -> dict[str, Any]:
    """Flags (as config keys) for `spec serve`: what the user set, the tuned tree (or no speculation when
    the baseline won), and the batch size as --max-running-requests and --cuda-graph-max-bs."""
    defaults = ServerArgs()
    values: dict[str, Any] = {}
    for f in dataclasses.fields(ServerArgs):
        value = getattr(user_args, f.name)
        if f.name == "api_key" or (value == getattr(defaults, f.name) and f.name != "model_path"):
            continue
        if tree is None and f.name.startswith("speculative_"):
            continue
        values[f.name] = value
    if tree is not None:
        values.update(speculative_num_steps=tree[0], speculative_eagle_topk=tree[1],
                      speculative_num_draft_tokens=tree[2])
    values.update(max_running_requests=batch_size, cuda_graph_max_bs=batch_size)
    ServerArgs.from_dict(values)          # what is saved must load
    order = [f.name for f in dataclasses.fields(ServerArgs)]
    return {name.replace("_", "-"): values[name] for name in sorted(values, key=order.index)}


def serve_command(config: dict[str, Any]) -> str:
    parts = ["spec", "serve"]
    for key, value in config.items():
        parts += [f"--{key}"] if value is True else [f"--{key}", shlex.quote(str(value))]
    return " ".join(parts)


def save_config(path: str | Path, config: dict[str, Any]) -> None:
    path = Path(path)
    if path.suffix == ".json":
        import json

        path.write_text(json.dumps(config, indent=2) + "\n")
    else:
        import yaml

        path.write_text("# spec serve --config " + path.name + "   (written by spec tune)\n"
                        + yaml.safe_dump(config, sort_keys=False))


# ------------------------------------------------------------------ spec tune end to end
def run_tune(args: ServerArgs, opts: TuneOptions, progress: Optional[Progress] = None) -> dict:
    from spec_tools.bench.offline import OfflineBackend, plain_args, tree_args
    from engine.engine import Engine

    opts.check()
    progress = progress or Silent()
    if not args.speculative_algorithm:
        raise BenchError("spec tune searches speculative tree shapes: pass --speculative-algorithm "
                         "(and --speculative-draft-model-path for EAGLE, EAGLE3 and STANDALONE).")
    trees, skipped = search_space(args, opts.steps, opts.topk, opts.draft_tokens)
    if not trees:
        raise BenchError("No valid tree in the search space: every combination has more draft tokens than "
                         "its tree holds (topk + (steps-1)*topk^2 + 1). Widen --search-steps / --search-topk or "
                         "lower --search-draft-tokens.")
    prompts = load_conversations(opts.dataset, opts.dataset_path, opts.num_prompts, seed=args.random_seed)
    batch_sizes = sorted(set(opts.batch_sizes))

    progress.phase(f"loading {args.model_path}")
    engine = Engine(server_args=dataclasses.replace(
        tree_args(args, trees[0]), max_running_requests=max(args.max_running_requests or 0, batch_sizes[-1])))
    resolved = engine.args
    plans = {bs: Plan.make(len(trees), len(prompts), bs) for bs in batch_sizes}
    progress.phase("tuning", sum(plan.evaluations(len(trees)) for plan in plans.values()))

    def backend(tree: Optional[Tree], bs: int) -> OfflineBackend:
        cand_args = plain_args(resolved) if tree is None else tree_args(resolved, tree)
        return OfflineBackend(engine, label(tree), cand_args, concurrency=bs,
                              max_new_tokens=opts.max_new_tokens, temperature=opts.temperature)

    warm_up(backend(None, 1), prompts[0])

    start = time.monotonic()
    result: dict[str, Any] = {"config": {"server_args": resolved.to_dict(), "model_dir": str(engine.model_dir),
                                         "tune": dataclasses.asdict(opts)},
                              "skipped": skipped, "batch_sizes": {}, "evaluations": 0, "prompt_runs": 0,
                              "out_of_time": False}
    for i, bs in enumerate(batch_sizes):
        def evaluate(tree: Optional[Tree], part: list[Conversation], r: int, bs: int = bs) -> PassResult:
            progress.advance(f"batch size {bs}, round {r + 1}: {label(tree)}", 0)
            passed = backend(tree, bs).run(part, lambda *_: None)
            result["evaluations"] += 1
            result["prompt_runs"] += len(part)
            progress.advance(f"batch size {bs}, round {r + 1}: {label(tree)}")
            return passed

        left = opts.time_budget - (time.monotonic() - start)
        deadline = time.monotonic() + left / (len(batch_sizes) - i)
        halving = successive_halving(trees, prompts, plans[bs], evaluate, deadline)
        rows = describe(halving)
        best = next(r for r in rows if r["status"] == "best")
        config = serve_config(args, halving.best, bs)
        result["batch_sizes"][str(bs)] = {"results": rows, "best": best, "config": config,
                                          "command": serve_command(config), "rounds": plans[bs].rounds}
        result["out_of_time"] |= halving.out_of_time
    result["duration_s"] = time.monotonic() - start
    result["full_grid_prompt_runs"] = (len(trees) + 1) * len(prompts) * len(batch_sizes)
    return result
