"""Picks the draft model and the drafter for --speculative-algorithm."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from engine.config import ServerArgs
from engine.speculative.drafter import Drafter


def load_draft_model(args: ServerArgs, target: nn.Module, target_dir, dtype: torch.dtype, device: str,
                     max_positions: int) -> Optional[nn.Module]:
    """The draft model the algorithm runs, loaded (None for plain decoding and NGRAM)."""
    algo = args.speculative_algorithm
    if algo in (None, "NGRAM"):
        return None
    if algo == "STANDALONE":
        from engine.speculative import standalone as kind
    else:  # EAGLE, EAGLE3, MTP
        from engine.speculative import eagle as kind
    return kind.load_draft(args, target, target_dir, dtype, device, max_positions)


def unseeded_rule(args: ServerArgs) -> str:
    """How sampled requests that gave no seed are verified (speculative/verify.py RULES); seeded ones
    are always coupled."""
    mode = args.speculative_sampling
    return "coupled" if mode == "auto" else mode


def create_drafter(args: ServerArgs, draft: Optional[nn.Module], target: nn.Module, num_slots: int,
                   max_rows: int, table: torch.Tensor, eos_ids) -> Optional[Drafter]:
    algo = args.speculative_algorithm
    if algo is None:
        return None
    if algo == "NGRAM":
        from engine.speculative.ngram import NgramDrafter

        return NgramDrafter(args, table.device)
    tree, sampling = args.speculative_tree, unseeded_rule(args)
    if algo == "STANDALONE":
        from engine.speculative.standalone import StandaloneDrafter

        return StandaloneDrafter(draft, num_slots, table, tree, sampling, eos_ids, args.attention_backend)
    from engine.speculative.eagle import EagleDrafter, MultiLayerMtpDrafter

    kind = MultiLayerMtpDrafter if args.enable_multi_layer_eagle else EagleDrafter
    return kind(draft, target, num_slots, max_rows, table, tree, sampling, eos_ids, args.attention_backend)
