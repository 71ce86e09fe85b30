"""GGUF files of the families llama.cpp writes beyond Llama and Gemma (Phi-3, Qwen2-MoE, Qwen3-MoE, OLMoE,
GPT-OSS, and Mixtral, which llama.cpp writes as "llama" with experts): a tiny random checkpoint made by
transformers' own class, written as llama.cpp's convert_hf_to_gguf.py writes it (tests/gguf_files.py:
fused q/k/v and gate/up for Phi-3 with its LongRoPE factors as tensors, experts stacked into one tensor
per projection, Qwen2-MoE's shared expert, GPT-OSS's sinks, yarn RoPE and expert biases), serves as the
checkpoint it was written from; with Q4_0/Q8_0 MLPs and experts (GPT-OSS: MXFP4, as its files hold them)
it keeps the file's blocks and serves them; files of other architectures are refused by theirs."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, ModelLoadError
from engine.core.forward_batch import make_batch
from engine.loader import convert_gguf, iter_weights, load_config, transformers_model
from engine.loader.gguf_quant import gguf_groups
from engine.models.quant import Int8GroupLinear, Q5Linear, W4A8Linear
from spec_kernels import cpu_w4a8
from tests.compiler import require
from tests.gguf_files import gguf_tokenizer, write_tiny_gguf
from tests.planning import untimed
from tests.tiny import make_model, random_prompts, reference_generate, tiny_runner

GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
# Sizes the quantized blocks take (rows of whole groups of 32), and Phi-3's window shorter than the prompts
# (which stay within its original context: its long factors are checked as read).
FAMILIES = {
    "phi3": dict(sliding_window=7, original_max_position_embeddings=64,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                  "original_max_position_embeddings": 64,
                                  "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                  "long_factor": [1.0 + 2.0 * i for i in range(8)]}),
    # llama.cpp's rules for these: Qwen2-MoE's and OLMoE's top k not renormalised, Qwen3-MoE's renormalised.
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    # The SwiGLU limit and yarn's rounding as llama.cpp's files mean them (no key says either).
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=7,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "original_max_position_embeddings": 64}),
}
# Phi-3's fused projections as llama.cpp stores them, everyone else's MLP and experts' parts.
QUANTIZED = {"gate_proj": "Q4_0", "up_proj": "Q4_0", "down_proj": "Q8_0", "qkv_proj": "Q4_0", "gate_up_proj": "Q4_0"}
# GPT-OSS's experts as its files hold them: MXFP4, kept as 5-bit groups (engine/loader/gguf_quant.py).
QUANTIZED_AS = {"gpt_oss": {"gate_proj": "MXFP4", "up_proj": "MXFP4", "down_proj": "MXFP4"}}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(arch, the transformers checkpoint, its tokenizer)."""
    tokenizer = gguf_tokenizer()
    root = tmp_path_factory.mktemp(request.param)
    return request.param, make_model(root / "hf", request.param, layers=2, vocab=len(tokenizer),
                                     **FAMILIES[request.param]), tokenizer


def written(family, path, linear_types=None, stacked=True):
    from transformers import AutoModelForCausalLM

    _, source, tokenizer = family
    write_tiny_gguf(path, AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32), tokenizer, linear_types,
                    stacked)
    return path


def test_gguf_serves_as_the_checkpoint_it_was_written_from(family, tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_CACHE_DIR", str(tmp_path / "cache"))
    arch, source, _ = family
    path = written(family, tmp_path / f"tiny-{arch}.gguf")
    prompts = random_prompts(3, seed=4, lo=10, hi=40)
    with Engine(planner=untimed, model_path=str(path), dtype="float32", max_total_tokens=2048) as eng:
        outs = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert outs == [reference_generate(source, p, GREEDY["max_new_tokens"]) for p in prompts]
    if arch == "phi3":          # the factors as the file stores them (float32)
        ours, theirs = load_config(convert_gguf(path)).rope_parameters, load_config(source).rope_parameters
        for key in ("short_factor", "long_factor"):
            assert torch.equal(torch.tensor(ours[key]), torch.tensor(theirs[key], dtype=torch.float32).double())
        assert ours["original_max_position_embeddings"] == 64


def test_quantized_gguf_keeps_its_blocks_and_serves_them(family, tmp_path, monkeypatch):
    """Q4_0 gate/up and Q8_0 down (Phi-3: its fused q/k/v and gate/up in Q4_0; GPT-OSS: MXFP4 experts): the
    converted directory keeps each expert's blocks as tensors of its own; dequantized (--dtype float32)
    every position's logits are transformers' on the same weights; under w4a8 an expert's layers hold
    the file's weights exactly."""
    require(cpu_w4a8._kernel)
    monkeypatch.setenv("SPEC_CACHE_DIR", str(tmp_path / "cache"))
    arch, _, tokenizer = family
    converted = convert_gguf(written(family, tmp_path / f"tiny-{arch}.Q4_0.gguf", QUANTIZED_AS.get(arch, QUANTIZED)))
    mlp = "model.layers.1.mlp" if arch == "phi3" else "model.layers.1.mlp.experts.3"
    # The checkpoint's names of its gate/up projection: Phi-3's fused as llama.cpp stores it.
    gate_up = [f"{mlp}.gate_up_proj.weight"] if arch == "phi3" else [f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"]
    groups, weights = gguf_groups(converted), dict(iter_weights(converted))
    gate_up_bits, down_bits = (5, 5) if arch == "gpt_oss" else (4, 8)
    assert {groups(n).bits for n in gate_up} == {gate_up_bits} and groups(f"{mlp}.down_proj.weight").bits == down_bits

    runner, kv = tiny_runner(converted)
    ids = tokenizer("hello world, the quick brown fox").input_ids
    batch = make_batch(kv.table, [0], [0], ids, kv.alloc(len(ids)), [len(ids)])
    with torch.no_grad():
        ours = runner.forward(batch, all_logits=True).logits
        theirs = transformers_model(converted, torch.float32)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)

    with Engine(planner=untimed, model_path=str(converted), quantization="w4a8", max_total_tokens=2048) as eng:
        layers = eng.debug.target.model.get_submodule(mlp)
        kinds = {4: W4A8Linear, 5: Q5Linear, 8: Int8GroupLinear}
        assert type(layers.gate_up_proj) is kinds[gate_up_bits] and type(layers.down_proj) is kinds[down_bits]
        assert torch.equal(layers.gate_up_proj.dequantized(), torch.cat([weights[n] for n in gate_up]))
        assert torch.equal(layers.down_proj.dequantized(), weights[f"{mlp}.down_proj.weight"])
        assert len(eng.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]) == GREEDY["max_new_tokens"]


def test_an_older_mixtral_file_with_a_tensor_per_expert_serves_too(tmp_path, monkeypatch):
    """Mixtral files written before April 2024 hold ffn_gate.{e}, ... : served as the checkpoint, each
    expert's Q4_0 blocks kept as they are."""
    monkeypatch.setenv("SPEC_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = gguf_tokenizer()
    source = make_model(tmp_path / "hf", "mixtral", layers=2, vocab=len(tokenizer), **FAMILIES["mixtral"])
    family = ("mixtral", source, tokenizer)
    path = written(family, tmp_path / "tiny-mixtral-old.gguf", stacked=False)
    prompts = random_prompts(2, seed=5, lo=10, hi=40)
    with Engine(planner=untimed, model_path=str(path), dtype="float32", max_total_tokens=2048) as eng:
        outs = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert outs == [reference_generate(source, p, GREEDY["max_new_tokens"]) for p in prompts]
    quantized = written(family, tmp_path / "tiny-mixtral-old.Q4_0.gguf", {"gate_proj": "Q4_0"}, stacked=False)
    assert gguf_groups(convert_gguf(quantized))("model.layers.1.mlp.experts.3.gate_proj.weight").bits == 4


def test_a_gguf_of_another_architecture_is_refused_by_it(tmp_path, monkeypatch):
    """Before any conversion: the file's architecture, and those that are served."""
    import gguf
    import numpy as np

    monkeypatch.setenv("SPEC_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny-mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"architecture 'mamba'.*qwen3moe \(Qwen3-MoE\)"):
        Engine(planner=untimed, model_path=str(path))
    assert not list((tmp_path / "cache").glob("converted/tiny-mamba*"))
