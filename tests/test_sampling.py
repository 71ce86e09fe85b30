"""Logit processing, truncation and sampling on known distributions; incremental detokenization."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare

from engine.core.detokenizer import IncrementalDetokenizer
from engine.errors import RequestError
from engine.core.sampling import SamplingBatch, keys, sample_from_probs, uniform
from engine.core.sampling_params import SamplingParams
from tests.compiler import require
from tests.tiny import target_probs

LOGITS = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))


def probs_for(**kw) -> torch.Tensor:
    return target_probs(LOGITS, SamplingParams(**kw), [])[0]


def batch(params: SamplingParams, prompt, output, eos_ids=()) -> SamplingBatch:
    req = SimpleNamespace(params=params, token_ids=list(prompt) + list(output), prompt_len=len(prompt), seed=0)
    return SamplingBatch([req], list(eos_ids), "cpu")


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
    ({"top_k": 2 ** 40}, [0.4, 0.3, 0.2, 0.1]),            # larger than the vocabulary: no cut
])
def test_truncation(kw, expected):
    torch.testing.assert_close(probs_for(**kw), torch.tensor(expected))


def test_mixed_batch_rows_follow_their_own_settings():
    reqs = [SimpleNamespace(params=SamplingParams(**kw), token_ids=[1], prompt_len=1, seed=0)
            for kw in ({"temperature": 0}, {"top_k": 2}, {"temperature": 0.5})]
    probs = SamplingBatch(reqs, [], "cpu").probs(LOGITS.expand(3, -1))
    torch.testing.assert_close(probs, torch.stack([probs_for(temperature=0), probs_for(top_k=2),
                                                   probs_for(temperature=0.5)]))


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    rep = batch(SamplingParams(repetition_penalty=2.0), [0], [1]).adjust(logits)
    torch.testing.assert_close(rep, torch.tensor([[1.0, -4.0, 1.0, 0.5]]))
    freq = batch(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [3], [2, 2, 0]).adjust(logits)
    torch.testing.assert_close(freq, torch.tensor([[2.0 - 0.75, -2.0, 1.0 - 1.25, 0.5]]))


def test_min_new_tokens_masks_eos():
    assert batch(SamplingParams(min_new_tokens=2), [], [5], eos_ids=[0]).adjust(LOGITS)[0, 0] == -math.inf
    assert batch(SamplingParams(min_new_tokens=2, temperature=0), [], [5], eos_ids=[0]).sample(LOGITS).item() == 1
    assert batch(SamplingParams(min_new_tokens=1, temperature=0), [], [5], eos_ids=[0]).sample(LOGITS).item() == 0


def test_inverse_cdf_draw_follows_distribution():
    probs = torch.tensor([[0.5, 0.0, 0.25, 0.25]])
    u = torch.linspace(0, 0.999, 400, dtype=torch.float64)
    draws = sample_from_probs(probs.expand(400, -1), u)
    counts = torch.bincount(draws, minlength=4)
    assert counts[1] == 0
    assert abs(counts[0].item() / 400 - 0.5) < 0.01 and abs(counts[2].item() / 400 - 0.25) < 0.01
    assert int(sample_from_probs(torch.tensor([[0.3, 0.7, 0.0]]), torch.tensor([0.999999]))) == 1


@pytest.mark.parametrize("kw", [{"temperature": 1.0}, {"temperature": 0.7}, {"temperature": 1.3, "top_k": 3},
                                {"temperature": 0.9, "top_p": 0.8}, {"temperature": 1.0, "min_p": 0.3}])
def test_keyed_draws_follow_the_processed_distribution(kw):
    """SamplingBatch.sample's keyed Gumbel-max draw, one request per key, is an exact sample of the row's
    distribution after temperature, top-k, top-p and min-p."""
    n = 20000
    logits = torch.log(torch.tensor([[0.35, 0.25, 0.2, 0.1, 0.06, 0.04]]))
    params = SamplingParams(**kw)
    reqs = [SimpleNamespace(params=params, token_ids=[1, 2], prompt_len=1, seed=s) for s in range(n)]
    sb = SamplingBatch(reqs, [], "cpu")
    draws = sb.sample(logits.expand(n, -1))
    expected = target_probs(logits, params, [])[0].double()
    counts = torch.bincount(draws, minlength=6).double()
    assert counts[expected == 0].sum() == 0
    keep = expected > 0
    assert chisquare(counts[keep], expected[keep] / expected[keep].sum() * n).pvalue > 0.001


@pytest.mark.parametrize("vocab", [5, 8, 1000, 49152])
def test_keyed_sample_kernel_equals_its_torch_reference(vocab):
    """The C kernel's early exits skip only tokens that cannot win: it draws the reference's token, for
    peaked, flat and truncated rows alike (a vocabulary not a multiple of the kernel's lanes too)."""
    from spec_kernels import cpu_keyed_sample

    require(cpu_keyed_sample._kernel)
    g = torch.Generator().manual_seed(vocab)
    rows = [torch.softmax(torch.randn(32, vocab, generator=g) * scale, -1) for scale in (0.1, 3.0, 12.0)]
    truncated = rows[1].clone()
    truncated[truncated < truncated.max(-1, keepdim=True).values * 0.2] = 0
    probs = torch.cat(rows + [truncated, torch.full((4, vocab), 1.0 / vocab)])
    k = torch.randint(-2 ** 63, 2 ** 63 - 1, (probs.shape[0],), generator=g)
    assert cpu_keyed_sample.keyed_sample(probs, k).tolist() == cpu_keyed_sample.reference(probs, k).tolist()


def _splitmix_reference(seed: int, position: int, stream: int) -> float:
    """The uniform hash in plain Python integers (mod 2**64), to pin the tensor version down."""
    mask, golden = 2 ** 64 - 1, 0x9E3779B97F4A7C15

    def mix(x):
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    h = mix((seed * golden + position) & mask)
    h = mix((h + (stream + 1) * golden) & mask)
    return (h >> 11) * 2.0 ** -53


def test_uniforms_are_a_fixed_hash_of_seed_position_stream():
    seeds, pos = torch.tensor([0, 1, 2 ** 62, -5]), torch.tensor([0, 7, 3, 2 ** 40])
    got = uniform(keys(seeds, pos, 3)).tolist()
    assert got == [_splitmix_reference(s % 2 ** 64, p, 3) for s, p in zip(seeds.tolist(), pos.tolist())]
    many = uniform(keys(torch.zeros(20000, dtype=torch.long), torch.arange(20000), 0))
    assert 0 <= many.min() and many.max() < 1 and abs(many.mean().item() - 0.5) < 0.01
    assert chisquare(torch.histc(many.float(), 10, 0, 1).tolist()).pvalue > 0.001


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
