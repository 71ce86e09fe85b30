"""Figures from a backend's passes: throughput, acceptance, latency percentiles, per-category breakdown;
and the comparison of a run with its baseline (speedup, differing outputs)."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from spec_tools.bench.measure import PassResult, TurnResult, merge

PERCENTILES = (50, 90, 99)


def distribution(values: Sequence[float]) -> Optional[dict]:
    if not values:
        return None
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def summarize(passes: Sequence[PassResult]) -> dict:
    run = merge(passes)
    turns, duration, steps, spec = run.turns, run.duration, run.decode_steps, run.spec
    tokens = sum(t.completion_tokens for t in turns)
    return {
        "num_requests": len(turns),
        "num_conversations": len({t.conversation for t in turns}),
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "completion_tokens": tokens,
        "duration_s": duration,
        "output_tokens_per_s": tokens / duration if duration > 0 else 0.0,
        "decode_tokens_per_s": decode_speed(turns),
        "requests_per_s": len(turns) / duration if duration > 0 else 0.0,
        "accept_length": spec.accept_length if spec else None,
        "accept_rate_by_position": spec.by_position if spec else None,
        "accept_length_histogram": spec.histogram if spec else None,
        "spec_verify_ct": round(spec.verify_ct) if spec else None,
        "decode_steps": steps or None,
        "step_time_ms": 1000 * run.decode_time / steps if steps else None,
        "ttft_s": distribution([t.ttft for t in turns if t.ttft is not None]),
        "itl_s": distribution([g for t in turns for g in t.gaps]),
        "e2e_latency_s": distribution([t.e2e for t in turns]),
        "categories": categories(turns),
        "prediction_tokens": prediction_tokens(turns),
    }


def decode_speed(turns: Sequence[TurnResult]) -> Optional[float]:
    """Tokens after the first over the time after the first: the decode phase, prefill left out (at
    batch 1 the figure llama.cpp's token-generation speed compares with)."""
    timed = [t for t in turns if t.ttft is not None and t.e2e > t.ttft]
    seconds = sum(t.e2e - t.ttft for t in timed)
    return sum(t.completion_tokens - 1 for t in timed) / seconds if seconds > 0 else None


def prediction_tokens(turns: Sequence[TurnResult]) -> Optional[dict]:
    """Predicted Output tokens accepted and rejected, over the requests that sent a prediction."""
    sent = [t.predicted for t in turns if t.predicted is not None]
    if not sent:
        return None
    return {"requests": len(sent), "accepted": sum(a for a, _ in sent), "rejected": sum(r for _, r in sent)}


def categories(turns: Sequence[TurnResult]) -> dict[str, dict]:
    """Per category: requests, tokens, each request's own speed (tokens / its latency) averaged, and
    acceptance where the backend reports it per request."""
    out: dict[str, dict] = {}
    for name in dict.fromkeys(t.category for t in turns):
        group = [t for t in turns if t.category == name]
        verify = sum(t.verify_ct or 0 for t in group)
        out[name] = {
            "num_requests": len(group),
            "completion_tokens": sum(t.completion_tokens for t in group),
            "output_tokens_per_s": float(np.mean([t.completion_tokens / t.e2e for t in group if t.e2e > 0] or [0.0])),
            "accept_length": 1 + sum(t.accepted or 0 for t in group) / verify if verify else None,
        }
    return out


def compare(run: Sequence[PassResult], baseline: Sequence[PassResult], run_figures: dict, base_figures: dict,
            greedy: bool) -> dict:
    """Speedup (ratio of output tokens/s) and, under greedy decoding, how many requests' outputs differ."""
    base_tps = base_figures["output_tokens_per_s"]
    out = {"speedup": run_figures["output_tokens_per_s"] / base_tps if base_tps > 0 else None,
           "differing_outputs": None, "differing_outputs_share": None}
    if greedy:
        ours = {(t.conversation, t.turn): t.output for p in run for t in p.turns}
        theirs = {(t.conversation, t.turn): t.output for p in baseline for t in p.turns}
        differing = sum(ours[k] != theirs.get(k) for k in ours)
        out["differing_outputs"] = differing
        out["differing_outputs_share"] = differing / len(ours) if ours else 0.0
    return out
