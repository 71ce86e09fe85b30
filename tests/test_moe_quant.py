"""Experts kept in a GGUF's quantized blocks on the CPU (w4a8): all the chosen experts' projections in one
kernel call each (kernels/cpu_w4a8.c spec_w4a8_grouped) give, bit for bit, what each expert's layers
give alone, so a row's result does not depend on the rows beside it; they approximate the dequantized
float experts as the kernel's int8 activations allow; and every speculative algorithm is lossless on a
quantized mixture served so."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.loader import gguf_quant
from engine.models.gpt_oss import GptOssExperts
from engine.models.moe import Experts
from engine.models.quant import Int8GroupLinear, W4A8Linear
from spec_kernels import cpu_w4a8
from tests.compiler import require
from tests.drafts import ALGOS, draft_setup
from tests.gguf_files import gguf_blocks, gguf_tokenizer, write_tiny_gguf
from tests.lossless import prompts as lossless_prompts
from tests.tiny import make_model, tiny_engine

HIDDEN, INTER, COUNT, TOP_K = 64, 96, 6, 2
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


def experts(quantized: bool, family: str = "llama") -> Experts:
    """COUNT experts (SwiGLU MLPs, or GPT-OSS's clamped ones with biases) with Q4_0 gate/up and Q8_0 down
    blocks: as w4a8 layers built from the blocks, or as float linears holding the weights those layers
    compute with."""
    config = SimpleNamespace(hidden_size=HIDDEN, intermediate_size=INTER, swiglu_limit=1.0, swiglu_alpha=1.702)
    module = (GptOssExperts if family == "gpt_oss" else Experts)(config, COUNT, INTER)
    g = torch.Generator().manual_seed(9)
    for e, mlp in enumerate(module):
        gate_up = gguf_quant.decode(gguf_blocks("Q4_0", 2 * INTER, HIDDEN, seed=e), "Q4_0", 2 * INTER)
        down = gguf_quant.decode(gguf_blocks("Q8_0", HIDDEN, INTER, seed=100 + e), "Q8_0", HIDDEN)
        biases = [linear.bias for linear in (mlp.gate_up_proj, mlp.down_proj)]     # None but GPT-OSS's
        with torch.no_grad():
            for bias in (b for b in biases if b is not None):
                bias.copy_(torch.randn(bias.shape, generator=g) * 0.1)
        layers = W4A8Linear.from_groups(gate_up, biases[0]), Int8GroupLinear.from_groups(down, biases[1])
        if quantized:
            mlp.gate_up_proj, mlp.down_proj = layers
        else:
            with torch.no_grad():
                for linear, layer in zip((mlp.gate_up_proj, mlp.down_proj), layers):
                    linear.weight.copy_(layer.dequantized())
    return module


def routed(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [tokens, HIDDEN], and each token's TOP_K distinct experts with their weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(COUNT, generator=g)[:TOP_K] for _ in range(tokens)])
    return torch.randn(tokens, HIDDEN, generator=g), torch.rand(tokens, TOP_K, generator=g).softmax(-1), ids


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_w4a8_experts_are_each_experts_own_layers(dtype, family):
    """One call per projection for all chosen experts (biases and GPT-OSS's clamped activation included)
    equals, bit for bit, each chosen expert's own layers on its rows; and a token's output is the same
    alone as among others (verification's rows)."""
    require(cpu_w4a8._kernel)
    module = experts(quantized=True, family=family)
    x, weights, ids = routed(11)
    x, weights = x.to(dtype), weights.to(dtype)
    with torch.no_grad():
        out = module(x, weights, ids)
        by_expert = torch.zeros_like(x)
        for e in range(COUNT):          # as transformers sums them: per token, by increasing expert
            rows, slot = (ids == e).nonzero(as_tuple=True)
            if len(rows):
                by_expert.index_add_(0, rows, (module[e](x[rows]) * weights[rows, slot, None]).to(dtype))
        alone = torch.cat([module(x[t:t + 1], weights[t:t + 1], ids[t:t + 1]) for t in range(len(x))])
    assert torch.equal(out, by_expert) and torch.equal(out, alone)


def test_w4a8_experts_approximate_the_dequantized_float_experts():
    """The same experts' weights in float: the outputs differ by the int8 rounding of the activations."""
    require(cpu_w4a8._kernel)
    quantized, dense = experts(quantized=True), experts(quantized=False)
    x, weights, ids = routed(9, seed=1)
    with torch.no_grad():
        ours, reference = quantized(x, weights, ids), dense(x, weights, ids)
    assert (ours - reference).abs().max() < 0.05 * reference.abs().max()


@pytest.fixture(scope="module")
def quantized_moe(tmp_path_factory):
    """Tiny Mixtral and Qwen3-MoE GGUFs with Q4_0 gate/up and Q8_0 down experts, converted: the directory
    the engine serves them from, which the drafts' checkpoints are built against."""
    from transformers import AutoModelForCausalLM

    from engine.loader import convert_gguf

    root = tmp_path_factory.mktemp("moe")
    tokenizer = gguf_tokenizer()
    extras = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
              "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)}
    converted = {}
    with pytest.MonkeyPatch.context() as mp:          # the conversions stay in this module's folder
        mp.setenv("SPEC_CACHE_DIR", str(root / "cache"))
        for arch, extra in extras.items():
            source = make_model(root / arch, arch, layers=2, vocab=len(tokenizer), **extra)
            path = root / f"tiny-{arch}.Q4_0.gguf"
            write_tiny_gguf(path, AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32), tokenizer,
                            {"gate_proj": "Q4_0", "up_proj": "Q4_0", "down_proj": "Q8_0"})
            converted[arch] = convert_gguf(path)
    return converted


# The test's MTP layer is Llama's, without Qwen3's q/k norms (tests/test_families.py).
@pytest.mark.parametrize("arch, algo",
                         [("mixtral", a) for a in ALGOS] + [("qwen3_moe", a) for a in ALGOS if a != "MTP"])
def test_speculation_is_lossless_on_w4a8_experts(arch, algo, quantized_moe, tmp_path):
    require(cpu_w4a8._kernel)
    prompts = lossless_prompts()
    spec = draft_setup(algo, quantized_moe[arch], tmp_path, vocab=300)
    model = spec.pop("model_path", quantized_moe[arch])
    plain = tiny_engine(model, quantization="w4a8", dtype="bfloat16")
    assert type(plain.debug.target.model.model.layers[1].mlp.experts[0].gate_up_proj) is W4A8Linear
    expected = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=GREEDY)]
    eng = tiny_engine(model, algo, tree=(3, 2, 6), quantization="w4a8", dtype="bfloat16", **spec)
    assert [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)] == expected
    assert eng.stats()["spec_verify_ct"] > 0
