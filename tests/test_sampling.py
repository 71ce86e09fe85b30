"""Logit processing, truncation and sampling on known distributions; incremental detokenization."""

from __future__ import annotations

import math

import pytest
import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.errors import RequestError
from engine.sampling import Row, adjust_logits, sample, sample_from_probs, target_probs
from engine.sampling_params import SamplingParams

LOGITS = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))


def probs_for(**kw) -> torch.Tensor:
    return target_probs(LOGITS, [Row(SamplingParams(**kw), [], [])])[0]


def test_plain_temperature_one_is_softmax():
    torch.testing.assert_close(probs_for(temperature=1.0), torch.tensor([0.4, 0.3, 0.2, 0.1]))


def test_temperature_sharpens():
    p = probs_for(temperature=0.5)
    expected = torch.tensor([0.16, 0.09, 0.04, 0.01]) / 0.30
    torch.testing.assert_close(p, expected)


def test_greedy_is_one_hot_argmax():
    torch.testing.assert_close(probs_for(temperature=0.0), torch.tensor([1.0, 0, 0, 0]))
    torch.testing.assert_close(probs_for(top_k=1), torch.tensor([1.0, 0, 0, 0]))


@pytest.mark.parametrize("kw, expected", [
    ({"top_k": 2}, [0.4 / 0.7, 0.3 / 0.7, 0, 0]),
    ({"top_p": 0.6}, [0.4 / 0.7, 0.3 / 0.7, 0, 0]),       # 0.4 < 0.6: the second token is still needed
    ({"top_p": 0.4}, [1.0, 0, 0, 0]),
    ({"top_p": 0.75}, [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0]),
    ({"min_p": 0.5}, [0.4 / 0.7, 0.3 / 0.7, 0, 0]),       # keep p >= 0.5 * 0.4
    ({"top_k": 3, "top_p": 0.5}, [0.4 / 0.7, 0.3 / 0.7, 0, 0]),
])
def test_truncation(kw, expected):
    torch.testing.assert_close(probs_for(**kw), torch.tensor(expected))


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    rep = adjust_logits(logits, [Row(SamplingParams(repetition_penalty=2.0), [0], [1])])
    torch.testing.assert_close(rep, torch.tensor([[1.0, -4.0, 1.0, 0.5]]))
    freq = adjust_logits(logits, [Row(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [3], [2, 2, 0])])
    torch.testing.assert_close(freq, torch.tensor([[2.0 - 0.75, -2.0, 1.0 - 1.25, 0.5]]))


def test_min_new_tokens_masks_eos():
    row = Row(SamplingParams(min_new_tokens=2), [], [5], eos_ids=[0])
    assert adjust_logits(LOGITS, [row])[0, 0] == -math.inf
    assert sample(LOGITS, [Row(SamplingParams(min_new_tokens=2, temperature=0), [], [5], [0])], [0.0]).item() == 1


def test_inverse_cdf_draw_follows_distribution():
    probs = torch.tensor([[0.5, 0.0, 0.25, 0.25]])
    draws = [int(sample_from_probs(probs, [u])) for u in torch.linspace(0, 0.999, 400).tolist()]
    counts = torch.bincount(torch.tensor(draws), minlength=4)
    assert counts[1] == 0
    assert abs(counts[0].item() / 400 - 0.5) < 0.01 and abs(counts[2].item() / 400 - 0.25) < 0.01
    assert int(sample_from_probs(torch.tensor([[0.3, 0.7, 0.0]]), [0.999999])) == 1


def test_sampling_params_validation_and_aliases():
    p = SamplingParams.from_dict({"stop": "END", "sampling_seed": 3})
    assert p.stop == ["END"] and p.seed == 3
    for bad in ({"top_p": 0}, {"min_p": 2}, {"n": 0}, {"stop_token_ids": [-1]}, {"seed": "x"}, {"max_new_tokens": 1.5}):
        with pytest.raises(RequestError):
            SamplingParams.from_dict(bad)


def test_incremental_detokenizer_matches_full_decode(tmp_path):
    from tests.tiny import make_tokenizer

    tok = make_tokenizer(tmp_path)
    text = "Caf\u00e9 \u65e5\u672c\u8a9e \U0001F600 and the quick brown fox"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.step(ids[:i]) for i in range(1, len(ids) + 1)]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)   # never half a character
