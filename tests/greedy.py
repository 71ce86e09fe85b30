"""Greedy decoding of seeded random prompts: the parameters, the prompts (ids 3..299, random lengths in
[lo, hi)) and an engine's output ids for them, as the engine's and the draft models' tests compare them."""

from __future__ import annotations

import torch

from engine import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def generate(eng: Engine, ps, params=GREEDY) -> list[list[int]]:
    return [o["output_ids"] for o in eng.generate(input_ids=ps, sampling_params=params)]
