"""Assembles an engine from ServerArgs: model source, tokenizer, runner, decode worker, scheduler."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from engine.config import ServerArgs

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    model_dir: Path
    model_config: object
    tokenizer: object
    runner: object
    worker: object
    scheduler: object
    eos_ids: list[int]


def eos_token_ids(model_dir: Path, config, tokenizer) -> list[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer (chat models often list several)."""
    ids: list = []
    try:
        from transformers import GenerationConfig

        ids.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    except (OSError, ValueError):
        pass
    ids += [getattr(config, "eos_token_id", None), tokenizer.eos_token_id]
    flat: list[int] = []
    for x in ids:
        for t in (x if isinstance(x, (list, tuple)) else [x]):
            if isinstance(t, int) and t not in flat:
                flat.append(t)
    return flat


def build_engine_parts(args: ServerArgs) -> EngineParts:
    from engine.loader import load_config, load_tokenizer, resolve_model_path
    from engine.model_runner import ModelRunner
    from engine.scheduler import Scheduler
    from engine.speculative.factory import create_worker

    model_dir = resolve_model_path(args.model_path, args.revision)
    config = load_config(model_dir)
    max_pos = getattr(config, "max_position_embeddings", None) or 4096
    args.resolve_for_model(config.model_type, max_pos)
    if args.context_length > max_pos:
        log.warning("--context-length %d exceeds the model's max_position_embeddings %d; outputs past it "
                    "may degrade", args.context_length, max_pos)
    tokenizer = load_tokenizer(args.tokenizer_path or model_dir)
    runner = ModelRunner(args, model_dir, config)
    eos = eos_token_ids(model_dir, config, tokenizer)
    worker = create_worker(args, runner, eos)
    scheduler = Scheduler(args, runner, tokenizer, worker, eos)
    return EngineParts(model_dir, config, tokenizer, runner, worker, scheduler, eos)
