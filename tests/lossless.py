"""What the lossless checks of every algorithm share: greedy prompts and a speculative engine on a fixed
tree, and for sampling an 8-token vocabulary, its exact two-token distribution and a chi-square test
against it. Used by test_speculative_lossless.py and the tests that repeat its checks under other
features (structured output, tensor parallelism, CUDA graphs, ...)."""

from __future__ import annotations

import pytest
import torch

from engine import Engine
from engine.core.sampling_params import SamplingParams
from tests.drafts import draft_setup, module_for
from tests.planning import untimed
from tests.tiny import target_probs

GREEDY = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    out = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 17, 33, 9)]
    out.append([10, 11, 12, 13, 14, 15] * 5)       # repetitive: n-grams and drafts get accepted
    return out


def spec_engine(algo, target, tmp_path, shape, **kw) -> Engine:
    pytest.importorskip(module_for(algo))
    steps, topk, tokens = shape
    # Fixed trees: every step drafts and verifies the whole tree (adaptive sizes: test_adaptive_drafts.py).
    kw = {"model_path": str(target), "max_total_tokens": 8192, "speculative_adaptive": "off",
          **draft_setup(algo, target, tmp_path), **kw}
    return Engine(dtype="float32", speculative_algorithm=algo, speculative_num_steps=steps,
                  speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens, planner=untimed, **kw)


# ---------------------------------------------------------------------------------------- sampling
VOCAB = 8
SAMPLES = 1500
SAMPLE_PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]


def exact_two_token_distribution(model_dir, prompt, params: SamplingParams) -> torch.Tensor:
    """P(x1, x2 | prompt) under the target with the request's temperature and truncation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        first = target_probs(model(torch.tensor([prompt])).logits[0, -1:], params, prompt)[0]
        joint = torch.zeros(VOCAB, VOCAB)
        for a in range(VOCAB):
            logits = model(torch.tensor([prompt + [a]])).logits[0, -1:]
            joint[a] = first[a] * target_probs(logits, params, prompt, [a])[0]
    return joint


def chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    from scipy.stats import chisquare

    exp = expected.flatten().double() / expected.sum() * counts.sum()
    obs = counts.flatten().double()
    assert obs[exp == 0].sum() == 0, "a sequence the target cannot produce came out"
    big = exp >= 5                         # pool rare cells so every bin expects >= 5
    o = torch.cat([obs[big], obs[~big].sum(0, keepdim=True)])
    e = torch.cat([exp[big], exp[~big].sum(0, keepdim=True)])
    keep = e > 0
    o, e = o[keep], e[keep]
    return chisquare(o, e / e.sum() * o.sum()).pvalue
