"""FP8 weights: the e4m3 quantize/dequantize math (per output channel, 128x128 blocks) against a float
reference, the FP8 linear's forward through its torch reference GEMM (and torch's own _scaled_mm where
the CPU build has it), FP8 checkpoints (both schemes) served on the CPU dequantized, token for token as
the dequantized model, and loaded as stored into FP8 layers, and what is refused and why."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from engine import Engine
from engine.errors import ConfigError, ModelLoadError
from engine.loader import iter_weights, load_config
from engine.loader.fp8_quant import E4M3, E4M3_MAX, quantize, stored_weight
from engine.core.model_runner import load_model
from engine.models.fp8 import Fp8Linear, quantize_activations, reference_gemm, scaled_gemm
from tests.fp8_checkpoints import blockwise, dequantized_reference, save_fp8_checkpoint
from tests.planning import untimed
from tests.tiny import make_model, random_prompts, reference_greedy, tiny_engine

GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
SCHEMES = {"channel": None, "block": (128, 128)}


def outlying_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3, 5] = 4.0            # an outlier: its scale (a row's, a block's) is 80x the others'
    w[7] = 0.0               # a zero row
    return w


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantize_scales_and_rounding_against_float(scheme):
    """Each scale is its block's largest magnitude over 448 (that value becomes +-448 exactly), and every
    weight is within e4m3's rounding: half a step of 3 mantissa bits, or of the smallest subnormal."""
    block = SCHEMES[scheme]
    w = outlying_weight(300, 200)           # partial blocks on both axes under 128x128
    q, scale = quantize(w, block)
    assert q.dtype == E4M3 and scale.dtype == torch.float32
    assert scale.shape == ((3, 2) if block else (300, 1))
    for rows, columns, at in blockwise(w, block):
        amax = w[rows, columns].abs().max()
        if amax > 0:
            assert torch.isclose(scale[at], amax / E4M3_MAX, rtol=1e-6)
            assert q[rows, columns].float().abs().max() == E4M3_MAX
        else:
            assert not q[rows, columns].float().any()
    assert q.float().abs().max() <= E4M3_MAX and not q.float().isnan().any()
    deq = dequantized_reference(q, scale, block)
    step = torch.empty_like(w)
    for rows, columns, at in blockwise(w, block):
        step[rows, columns] = scale[at]
    bound = torch.maximum(w.abs() * 2 ** -4, step * 2 ** -10)
    assert ((deq - w).abs() <= bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("layout", ["tensor", "channel", "channel_2d", "block"])
def test_stored_scale_layouts_dequantize_as_the_checkpoint_means(layout):
    """Per-tensor (a scalar), per-channel ([N] or [N, 1]) and block scales ([N/128, K/128]) all become one
    scale per row and block of columns, with the same values."""
    w = outlying_weight(300, 200)
    block = (128, 128) if layout == "block" else None
    q, scale = quantize(w, block)
    if layout == "tensor":
        scale = scale.max().reshape(())
        q = (w / scale).to(E4M3)
    elif layout == "channel":
        scale = scale.view(-1)
    weight = stored_weight(q, scale, block, "x.weight")
    expected = q.float() * scale if layout == "tensor" else dequantized_reference(q, scale.view(-1, 1) if layout == "channel" else scale, block)
    assert torch.equal(weight.dequantize(), expected)
    assert torch.equal(weight.to(torch.bfloat16), expected.to(torch.bfloat16))


def test_stored_scales_of_the_wrong_shape_are_refused():
    q, scale = quantize(outlying_weight(300, 200), (128, 128))
    with pytest.raises(ModelLoadError, match=r"x.weight: scale of shape \[2, 2\] does not fit 128x128 blocks"):
        stored_weight(q, scale[:2], (128, 128), "x.weight")
    with pytest.raises(ModelLoadError, match="fits neither"):
        stored_weight(q, torch.ones(7), None, "x.weight")


def test_activations_are_quantized_per_token_and_group():
    x = outlying_weight(9, 256, seed=1)
    for group in (256, 128):
        a, scale = quantize_activations(x, group)
        assert scale.shape == (9, 256 // group)
        for t in range(9):
            for j in range(256 // group):
                part = x[t, j * group:(j + 1) * group]
                if part.abs().max() > 0:
                    assert torch.isclose(scale[t, j], part.abs().max() / E4M3_MAX, rtol=1e-6)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fp8_linear_computes_its_reference_gemm(scheme):
    """On a CPU the layer quantizes activations as on a GPU and multiplies through the GEMM's reference: the
    dequantized activations times the dequantized weights; near the float product, within FP8's error."""
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(384, 256, generator=g) * 0.05, torch.randn(2, 3, 256, generator=g)
    bias = torch.nn.Parameter(torch.randn(384, generator=g))
    weight = stored_weight(*quantize(w, SCHEMES[scheme]), SCHEMES[scheme], "w")
    layer = Fp8Linear(weight, bias)
    assert layer.path == "reference" and layer.group == (128 if SCHEMES[scheme] else 256)
    y = layer(x)
    rows = x.reshape(-1, 256)
    group = layer.group
    deq_x = torch.cat([rows[:, j:j + group] / (rows[:, j:j + group].abs().amax(-1, keepdim=True) / E4M3_MAX)
                       for j in range(0, 256, group)], dim=1).to(E4M3).float()
    deq_x = deq_x * torch.cat([(rows[:, j:j + group].abs().amax(-1, keepdim=True) / E4M3_MAX).expand(-1, group)
                               for j in range(0, 256, group)], dim=1)
    expected = (deq_x @ weight.dequantize().t()).to(torch.bfloat16).float() + bias
    torch.testing.assert_close(y.reshape(-1, 384), expected, rtol=0, atol=1e-5)
    exact = torch.nn.functional.linear(x, w, bias)
    assert (y - exact).abs().max() < 0.1 * exact.abs().max()


def test_weight_only_path_multiplies_by_the_dequantized_weight():
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(64, 200, generator=g), torch.randn(4, 200, generator=g)
    layer = Fp8Linear(stored_weight(*quantize(w, (128, 128)), (128, 128), "w"), None)
    assert layer.path == "weight_only"      # 200 columns: activations cannot be grouped by 128
    torch.testing.assert_close(layer(x), x @ layer.fp8_weight().dequantize().t())


def test_torch_scaled_mm_is_called_as_the_reference_computes():
    """torch._scaled_mm with row-wise scales runs on this CPU build: the call the GPU makes, with the same
    operand layouts and scales, gives the reference's product."""
    g = torch.Generator().manual_seed(4)
    weight = stored_weight(*quantize(torch.randn(64, 128, generator=g)), None, "w")
    a, a_scale = quantize_activations(torch.randn(5, 128, generator=g) * 3, 128)
    try:
        out = scaled_gemm(a, a_scale, weight.q, weight.scale)
    except RuntimeError as e:
        pytest.skip(f"this torch has no CPU _scaled_mm: {e}")
    torch.testing.assert_close(out.float(), reference_gemm(a, a_scale, weight.q, weight.scale).float(),
                               rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    # 192 wide: partial 128-blocks on both axes, and q/k/v parts of 192 and 96 rows fused.
    return make_model(tmp_path_factory.mktemp("float"), "llama", hidden=192, seed=5)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fp8_checkpoint_on_cpu_is_served_dequantized(scheme, float_model, tmp_path, caplog):
    """Greedy tokens are the dequantized model's (transformers' own forward), not the float original's."""
    fp8, ref = save_fp8_checkpoint(float_model, tmp_path / "fp8", SCHEMES[scheme])
    prompts = random_prompts(3, seed=6)
    with caplog.at_level(logging.INFO, logger="engine.core.model_runner"):
        eng = Engine(planner=untimed, model_path=str(fp8), dtype="float32", max_total_tokens=2048)
    assert "FP8 checkpoint" in caplog.text and "dequantized to torch.float32" in caplog.text
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [reference_greedy(ref, p, 16) for p in prompts]


def test_deepseek_block_fp8_checkpoint_is_read(tmp_path):
    """DeepSeek-V3's release layout (MLA and expert linears in e4m3, 128x128 `weight_scale_inv`): served
    dequantized on the CPU as the dequantized model, and loaded as stored into FP8 layers throughout."""
    from tests.tiny import make_deepseek

    fp8, ref = save_fp8_checkpoint(make_deepseek(tmp_path / "float"), tmp_path / "fp8", (128, 128))
    prompts = random_prompts(2, seed=9)
    eng = Engine(planner=untimed, model_path=str(fp8), dtype="float32", max_total_tokens=2048)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [reference_greedy(ref, p, 16) for p in prompts]
    model = load_model(fp8, load_config(fp8), torch.float32, "cpu", 64, prepack=False, quantization="fp8")
    attention, moe = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert all(isinstance(m, Fp8Linear) for m in (attention.q_a_proj, attention.kv_b_proj, attention.o_proj,
                                                   moe.experts[0].gate_up_proj, moe.shared_experts.down_proj))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fp8_checkpoint_loads_as_stored_into_fp8_layers(scheme, float_model, tmp_path):
    """What a CUDA GPU loads (here on the CPU, the layers on their reference GEMM): every decoder linear
    an Fp8Linear holding the checkpoint's values, q/k/v and gate/up fused with their scales; a layer the
    checkpoint keeps in float stays float."""
    fp8, ref = save_fp8_checkpoint(float_model, tmp_path / "fp8", SCHEMES[scheme], keep_float=("layers.1.mlp.down",))
    config = load_config(fp8)
    model = load_model(fp8, config, torch.float32, "cpu", 64, prepack=False, quantization="fp8")
    reference = load_model(ref, load_config(ref), torch.float32, "cpu", 64, prepack=False)
    for i, (layer, twin) in enumerate(zip(model.model.layers, reference.model.layers)):
        for part, parent, twin_parent in (("qkv_proj", layer.self_attn, twin.self_attn),
                                          ("o_proj", layer.self_attn, twin.self_attn),
                                          ("gate_up_proj", layer.mlp, twin.mlp), ("down_proj", layer.mlp, twin.mlp)):
            linear, expected = getattr(parent, part), getattr(twin_parent, part).weight
            if i == 1 and part == "down_proj":
                assert type(linear) is torch.nn.Linear and torch.equal(linear.weight, expected)
            else:
                assert isinstance(linear, Fp8Linear) and torch.equal(linear.fp8_weight().dequantize(), expected)
    assert model.weight_bytes < reference.weight_bytes


def test_online_fp8_rounds_each_output_channel(float_model):
    """--quantization fp8's layers (built on the CPU here): the float weights rounded per output channel."""
    model = load_model(float_model, load_config(float_model), torch.float32, "cpu", 64, prepack=False,
                       quantization="fp8")
    weights = dict(iter_weights(float_model))
    qkv = model.model.layers[0].self_attn.qkv_proj
    fused = torch.cat([weights[f"model.layers.0.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
    assert isinstance(qkv, Fp8Linear) and qkv.block == fused.shape[1]
    assert torch.equal(qkv.fp8_weight().dequantize(), dequantized_reference(*quantize(fused), None))


# ------------------------------------------------------------------------------------------ refusals
def test_fp8_quantization_is_refused_on_a_cpu(float_model, tmp_path):
    with pytest.raises(ConfigError, match=r"--quantization fp8 runs on one CUDA GPU.*compute capability 8.9.*"
                                          r"On a CPU leave it out, or on a CPU pick w4a8, w8a8_int8 or int4"):
        Engine(model_path=str(float_model), device="cpu", quantization="fp8", max_total_tokens=256)
    fp8, _ = save_fp8_checkpoint(float_model, tmp_path / "fp8", None)
    with pytest.raises(ConfigError, match=r"leave it out \(an FP8 checkpoint loads dequantized\)"):
        Engine(model_path=str(fp8), device="cpu", quantization="fp8", max_total_tokens=256)


def test_fp8_quantization_is_refused_with_tensor_parallelism():
    from engine.config import ServerArgs

    with pytest.raises(ConfigError, match="--quantization fp8 cannot be used with --tp-size > 1"):
        ServerArgs(quantization="fp8", tp_size=2)


@pytest.mark.parametrize("quantization_config, message", [
    ({"quant_method": "gptq", "bits": 4}, "holds gptq-quantized weights.*FP8 release"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "FP8 format is e5m2; spec reads e4m3"),
    ({"quant_method": "fp8", "activation_scheme": "per_tensor"}, "FP8 activation_scheme is 'per_tensor'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size \\[128\\] is not two positive integers"),
])
def test_unreadable_quantized_checkpoints_are_refused_before_loading(quantization_config, message, float_model, tmp_path):
    model_dir = tmp_path / "q"
    shutil.copytree(float_model, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    with pytest.raises(ModelLoadError, match=message):
        Engine(model_path=str(model_dir), max_total_tokens=256)


def test_an_fp8_weight_without_its_scale_is_refused(float_model, tmp_path):
    from safetensors.torch import load_file, save_file

    fp8, _ = save_fp8_checkpoint(float_model, tmp_path / "fp8", None)
    tensors = load_file(fp8 / "model.safetensors")
    del tensors["model.layers.0.mlp.down_proj.weight_scale"]
    save_file(tensors, fp8 / "model.safetensors")
    with pytest.raises(ModelLoadError, match="model.layers.0.mlp.down_proj: an FP8 weight without its scale"):
        Engine(model_path=str(fp8), max_total_tokens=256)


@pytest.fixture(scope="module")
def aligned_model(tmp_path_factory):
    """Every layer's inputs a multiple of 128 wide: block-scaled layers multiply W8A8, not weight-only."""
    return make_model(tmp_path_factory.mktemp("aligned"), "llama", hidden=256, seed=8)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("algo", ["NGRAM", "EAGLE3"])
def test_speculation_is_lossless_on_fp8_layers(scheme, algo, aligned_model, tmp_path, monkeypatch, caplog):
    """The FP8 layers as a GPU serves them (activations quantized per token), here through the GEMM's
    reference: speculative greedy output equals plain decoding's on the same FP8 target."""
    from engine.core import model_runner
    from tests.drafts import draft_setup

    monkeypatch.setattr(model_runner, "_fp8", lambda name, model_dir, device: "fp8")    # the CPU refuses it
    fp8, _ = save_fp8_checkpoint(aligned_model, tmp_path / "fp8", SCHEMES[scheme])
    prompts = random_prompts(3, seed=7) + [[10, 11, 12, 13] * 6]
    with caplog.at_level(logging.INFO, logger="engine.core.model_runner"):
        plain = tiny_engine(fp8)
    assert "FP8 layers" in caplog.text and "8 reference" in caplog.text        # 2 layers x 4 linears
    expected = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=GREEDY)]
    eng = tiny_engine(fp8, algo, **draft_setup(algo, aligned_model, tmp_path))
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == expected
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)
