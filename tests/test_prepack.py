"""CPU weight prepacking (engine/models/prepack.py) computes what F.linear computes, and the engine uses it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import Engine
from engine.models.prepack import PrepackedLinear, can_prepack
from tests.planning import untimed
from tests.tiny import make_model

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("owned", [True, False])
def test_prepacked_linear_matches_f_linear(dtype, owned):
    if not can_prepack("cpu", dtype):
        pytest.skip(f"no oneDNN {dtype} on this CPU")
    torch.manual_seed(0)
    lin = nn.Linear(48, 40).to(dtype)
    weight, bias = lin.weight.detach().clone(), lin.bias.detach().clone()
    packed = PrepackedLinear(lin.weight, lin.bias, owned=owned)
    for rows in (0, 1, 2, 17):           # every path: empty, GEMV, packed
        x = torch.randn(rows, 48).to(dtype)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(packed(x).float(), F.linear(x.float(), weight.float(), bias.float()),
                                   atol=tol, rtol=tol)
    if owned and dtype == torch.bfloat16:      # the packed copy replaces the weight: only its shape stays
        assert packed.weight.device.type == "meta" and packed.weight.shape == weight.shape
    else:
        assert torch.equal(packed.weight, weight)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_prepacks_cpu_weights_and_decodes_the_same(tmp_path, dtype):
    if not can_prepack("cpu", getattr(torch, dtype)):
        pytest.skip(f"no oneDNN {dtype} on this CPU")
    eng = Engine(planner=untimed, model_path=str(make_model(tmp_path, "llama")), dtype=dtype, max_total_tokens=2048)
    model = eng.debug.target.model
    assert isinstance(model.model.layers[0].mlp.down_proj, PrepackedLinear) and model.packed_head is not None
    prompts = [[5, 6, 7, 8, 9], [11, 3, 250, 17, 4, 4, 90]]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    batched = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    # One request decodes on the one-row path, two together on the packed path.
    alone = [eng.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
    assert batched == alone and all(len(o) == 12 for o in alone)


@pytest.mark.parametrize("native", [True, False])
def test_bf16_only_where_the_cpu_computes_it_natively(monkeypatch, native):
    """dtype auto and training precision auto pick bf16 only where it is native: emulated bf16 linears
    run several times slower than fp32 (AVX2-only CPUs)."""
    import types

    from engine.core import model_runner
    from spec_tools.convert import train_eagle3
    from engine.models import prepack

    monkeypatch.setattr(prepack, "native_bf16", lambda device: native)
    monkeypatch.setattr(model_runner, "native_bf16", lambda device: native)
    half = types.SimpleNamespace(dtype="bfloat16")
    assert model_runner.resolve_dtype("auto", half, "cpu") == (torch.bfloat16 if native else torch.float32)
    assert model_runner.resolve_dtype("auto", types.SimpleNamespace(dtype="float32"), "cpu") == torch.float32
    assert model_runner.resolve_dtype("bfloat16", half, "cpu") == torch.bfloat16      # asked for: kept
    assert train_eagle3.resolve_precision("auto", "cpu") == ("bf16" if native else "fp32")
    assert train_eagle3.resolve_precision("fp32", "cpu") == "fp32"
