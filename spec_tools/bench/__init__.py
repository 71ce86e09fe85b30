"""Benchmarking and tuning speculative decoding: `spec bench` and `spec tune`.

    datasets.py  prompt sets (MT-Bench, GSM8K, question.jsonl files, ShareGPT, random) as Conversations
    measure.py   what one pass over conversations records, and interleaving runs against a baseline
    offline.py   runs passes in-process on an Engine, swapping its decode worker between configs
    online.py    runs passes against an OpenAI-compatible server over its streaming API
    summary.py   figures from the passes: throughput, acceptance, latency percentiles, categories
    run.py       `spec bench` end to end; report.py prints, saves and plots what it measured
    tune.py      `spec tune`: successive halving over tree shapes and batch sizes on one engine
"""

from engine.errors import SpecError


class BenchError(SpecError):
    """A benchmark cannot run as asked: missing or malformed dataset, unreachable server, bad options."""
