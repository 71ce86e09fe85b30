"""Picks the decode worker for --speculative-algorithm."""

from __future__ import annotations

from typing import Sequence

from engine.config import ServerArgs
from engine.model_runner import ModelRunner
from engine.worker import PlainWorker


def create_worker(args: ServerArgs, runner: ModelRunner, eos_ids: Sequence[int]) -> PlainWorker:
    algo = args.speculative_algorithm
    if algo is None:
        return PlainWorker(runner, eos_ids)
    if algo == "NGRAM":
        from engine.speculative.ngram import NgramWorker as cls
    elif algo == "STANDALONE":
        from engine.speculative.standalone import StandaloneWorker as cls
    else:  # EAGLE, EAGLE3, MTP
        from engine.speculative.eagle import EagleWorker as cls
    return cls(runner, eos_ids, args)
