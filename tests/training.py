"""Inputs for the tests of EAGLE-3 training and its data (spec convert): a prompt file of random words,
and TrainOptions sized for a tiny target on the CPU."""

from __future__ import annotations

import torch

from spec_tools.convert.train_eagle3 import TrainOptions

WORDS = "the quick brown fox jumps over lazy dog one two three four five six seven eight nine ten".split()


def write_prompts(path, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lines = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (6,), generator=g)) for _ in range(n)]
    path.write_text("\n".join(lines))
    return path


def options(target, output, prompts, **kw) -> TrainOptions:
    base = dict(model=str(target), output=output, prompts=(str(prompts),), num_prompts=24, max_new_tokens=32,
                gen_batch=8, draft_vocab=320, ttt_steps=3, batch_tokens=512, save_every=1000, device="cpu",
                dtype="float32", precision="fp32")
    return TrainOptions(**{**base, **kw})
