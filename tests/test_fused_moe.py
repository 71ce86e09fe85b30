"""The Triton mixture-of-experts kernel against its torch reference (on CPU in Triton's interpreter), with
GPT-OSS's biases and clamped activation too, and the reference against the engine's experts: the pairs' alignment by expert, batches from one token to
more pairs than experts' blocks, experts no token chose, one expert chosen by every token."""

from __future__ import annotations

import pytest
import torch

fused = pytest.importorskip("spec_kernels.fused_moe")
if not fused.available():
    pytest.skip("triton is not installed", allow_module_level=True)

E, H, INTER, K = 6, 64, 48, 2


def routing(tokens: int, seed: int, only: int | None = None):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(tokens, E, generator=g)
    if only is not None:                      # every token's first choice is this expert
        scores[:, only] += 100
    weights, ids = scores.softmax(-1).topk(K, dim=-1)
    return weights, ids


def expert_weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * INTER, H, generator=g) / H ** 0.5, torch.randn(E, H, INTER, generator=g) / INTER ** 0.5


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_alignment_lists_each_pair_once_under_its_expert(tokens):
    _, ids = routing(tokens, seed=tokens)
    pairs, block_expert = fused.align_by_expert(ids, E, block_m=4)
    assert pairs.numel() == block_expert.numel() * 4
    n = ids.numel()
    real = pairs[pairs < n]
    assert sorted(real.tolist()) == list(range(n))
    for b, e in enumerate(block_expert.tolist()):
        block = pairs[b * 4:(b + 1) * 4]
        chosen = block[block < n]
        if e < 0:
            assert chosen.numel() == 0
        else:
            assert chosen.numel() > 0 and (ids.reshape(-1)[chosen] == e).all()
    assert set(block_expert[block_expert >= 0].tolist()) == set(ids.unique().tolist())


def clamped(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's activation, clamped at 0.5 (so that the clamps matter at these sizes)."""
    gate, up = gate.clamp(max=0.5), up.clamp(-0.5, 0.5)
    return (up + 1) * (gate * torch.sigmoid(gate * 1.702))


@pytest.mark.parametrize("tokens, only", [(1, None), (5, None), (37, None), (9, 4)])
@pytest.mark.parametrize("with_biases", [False, True])
def test_kernel_matches_the_reference(tokens, only, with_biases):
    """Plain SwiGLU experts; with biases, GPT-OSS's: both biases added in the GEMMs, its clamped
    activation between them."""
    weights, ids = routing(tokens, seed=7 + tokens, only=only)
    w_gate_up, w_down = expert_weights(seed=1)
    g = torch.Generator().manual_seed(3)
    extra = dict(b_gate_up=torch.randn(E, 2 * INTER, generator=g), b_down=torch.randn(E, H, generator=g),
                 act=clamped) if with_biases else {}
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(2))
    got = fused.fused_moe(x, w_gate_up, w_down, weights, ids, **extra)
    torch.testing.assert_close(got, fused.fused_moe_reference(x, w_gate_up, w_down, weights, ids, **extra),
                               rtol=1e-4, atol=1e-5)


def test_reference_is_the_engines_experts():
    """The reference is what engine/models/moe.py's experts compute from the same weights."""
    from types import SimpleNamespace

    from engine.models.moe import Experts

    experts = Experts(SimpleNamespace(hidden_size=H, intermediate_size=INTER), E, INTER)
    w_gate_up, w_down = expert_weights(seed=3)
    with torch.no_grad():
        for e, mlp in enumerate(experts):
            mlp.gate_up_proj.weight.copy_(w_gate_up[e])
            mlp.down_proj.weight.copy_(w_down[e])
    weights, ids = routing(11, seed=5)
    x = torch.randn(11, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(experts(x, weights, ids), fused.fused_moe_reference(x, w_gate_up, w_down, weights, ids),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_stacked_experts_run_in_the_kernel_on_their_own_weights(family):
    """Experts.stack (done at load on CUDA): the experts' weights (and GPT-OSS's biases) become views of
    the stacked tensors the kernel reads, and the layer's output (GPT-OSS's clamped activation between
    the kernel's GEMMs) is what the experts computed before stacking."""
    from types import SimpleNamespace

    from engine.models.gpt_oss import GptOssExperts
    from engine.models.moe import Experts

    config = SimpleNamespace(hidden_size=H, intermediate_size=INTER, swiglu_limit=0.5)
    experts = (GptOssExperts if family == "gpt_oss" else Experts)(config, E, INTER)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / H ** 0.5)
    weights, ids = routing(13, seed=9)
    x = torch.randn(13, H, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        before = experts(x, weights, ids)
        assert experts.stack()
        stacked = experts.stacked
        assert experts[3].gate_up_proj.weight.data_ptr() == stacked.gate_up[3].data_ptr()
        assert experts[5].down_proj.weight.data_ptr() == stacked.down[5].data_ptr()
        if family == "gpt_oss":
            assert experts[2].gate_up_proj.bias.data_ptr() == stacked.gate_up_bias[2].data_ptr()
            assert experts[4].down_proj.bias.data_ptr() == stacked.down_bias[4].data_ptr()
        else:
            assert stacked.gate_up_bias is None and stacked.down_bias is None
        torch.testing.assert_close(experts(x, weights, ids), before, rtol=1e-4, atol=1e-5)
