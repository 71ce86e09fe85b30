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


def uses_rejection(args: ServerArgs) -> bool:
    """Whether sampled requests' chains are drawn from the draft and checked by rejection sampling."""
    mode = args.speculative_sampling
    return args.speculative_algorithm not in (None, "NGRAM") and (
        mode == "rejection" or (mode == "auto" and args.speculative_eagle_topk == 1))


def create_drafter(args: ServerArgs, draft: Optional[nn.Module], target: nn.Module, num_slots: int,
                   max_rows: int, table: torch.Tensor, eos_ids) -> Optional[Drafter]:
    algo = args.speculative_algorithm
    if algo is None:
        return None
    if algo == "NGRAM":
        from engine.speculative.ngram import NgramDrafter

        return NgramDrafter(args, table.device)
    tree, rejection = args.speculative_tree, uses_rejection(args)
    if algo == "STANDALONE":
        from engine.speculative.standalone import StandaloneDrafter

        return StandaloneDrafter(draft, num_slots, table, tree, rejection, eos_ids, args.attention_backend)
    from engine.speculative.eagle import EagleDrafter, MultiLayerMtpDrafter

    kind = MultiLayerMtpDrafter if args.enable_multi_layer_eagle else EagleDrafter
    return kind(draft, target, num_slots, max_rows, table, tree, rejection, eos_ids, args.attention_backend)
