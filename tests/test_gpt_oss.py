"""GPT-OSS beyond tests/test_families.py (greedy against transformers, every algorithm lossless): its
MXFP4 checkpoints (experts as e2m1 blocks and power-of-two scales), dequantized at load as transformers
dequantizes them or, quantized on a CPU, served from their blocks exactly, its sinks and experts under tensor parallelism, and what its GGUF files' header and
MXFP4 blocks read as (tests/test_gguf_families.py serves them)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine import Engine
from engine.errors import ModelLoadError
from engine.core.model_runner import resolve_quantization
from engine.loader import convert_gguf, gguf_quant, iter_weights, load_config, load_tokenizer, mxfp4
from engine.models.quant import Q5Linear
from spec_kernels import cpu_w4a8
from tests.compiler import require
from tests.gguf_files import TEXTS, gguf_tokenizer, write_tiny_gguf
from tests.lossless import GREEDY, prompts
from tests.planning import untimed
from tests.tiny import make_model, reference_generate, tiny_engine

# Windows shorter than the prompts, experts clamped often (tests/test_families.py says why).
CONFIG = dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=6, swiglu_limit=1.0)


def random_mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks [..., rows, columns / 32, 16], scales [..., rows, columns / 32]) of random e2m1 codes, every
    byte value among them, with powers of two about a weight's size (2^-6 to 2^-4)."""
    *lead, columns = shape
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*lead, columns // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(121, 124, (*lead, columns // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def transformers_dequantized(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' own MXFP4 dequantization (what its GptOssExperts holds: [experts, in, out]), float32."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)


def test_mxfp4_values_are_transformers_dequantization():
    blocks, scales = random_mxfp4((3, 8, 64), seed=0)
    scales[0, 0] = torch.tensor([0, 200], dtype=torch.uint8)        # 2^-127 (subnormal values), 2^73
    # Parts in either order, other tensors passed through as they are.
    stream = [("x.gate_up_proj_scales", scales), ("x.norm", torch.ones(2)), ("x.gate_up_proj_blocks", blocks)]
    out = dict(mxfp4.dequantized(stream))
    assert list(out) == ["x.norm", "x.gate_up_proj"]
    expected = transformers_dequantized(blocks, scales)
    assert out["x.gate_up_proj"].dtype == torch.bfloat16
    assert torch.equal(out["x.gate_up_proj"].float(), expected)         # bfloat16 holds every MXFP4 value


def test_incomplete_or_damaged_mxfp4_tensors_are_refused():
    blocks, scales = random_mxfp4((2, 4, 32), seed=1)
    with pytest.raises(ModelLoadError, match="x.down_proj: MXFP4 scales missing"):
        list(mxfp4.dequantized([("x.down_proj_blocks", blocks)]))
    with pytest.raises(ModelLoadError, match="x.down_proj: MXFP4 blocks .* not uint8"):
        list(mxfp4.dequantized([("x.down_proj_blocks", blocks.float()), ("x.down_proj_scales", scales)]))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(float directory, MXFP4 directory) of one tiny GPT-OSS whose experts are MXFP4 values: the float
    one holds them as transformers dequantizes the MXFP4 one's blocks."""
    float_dir = make_model(tmp_path_factory.mktemp("float"), "gpt_oss", layers=2, **CONFIG)
    quant_dir = make_model(tmp_path_factory.mktemp("mxfp4"), "gpt_oss", layers=2, **CONFIG)
    tensors, stored = load_file(float_dir / "model.safetensors"), {}
    for i, name in enumerate([n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]):
        experts, columns, rows = tensors[name].shape        # [experts, in, out]; MXFP4 stores [out, in]
        blocks, scales = random_mxfp4((experts, rows, columns), seed=i)
        tensors[name] = transformers_dequantized(blocks, scales)
        stored[f"{name}_blocks"], stored[f"{name}_scales"] = blocks, scales
    save_file(tensors, float_dir / "model.safetensors")
    save_file({**{n: t for n, t in tensors.items() if f"{n}_blocks" not in stored}, **stored},
              quant_dir / "model.safetensors")
    config = json.loads((quant_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (quant_dir / "config.json").write_text(json.dumps(config))
    return float_dir, quant_dir


def test_mxfp4_checkpoint_gives_transformers_greedy_tokens(checkpoints):
    float_dir, quant_dir = checkpoints
    ps = prompts()[:3]
    outs = tiny_engine(quant_dir).generate(input_ids=ps, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [reference_generate(float_dir, p, GREEDY["max_new_tokens"]) for p in ps]


def test_mxfp4_experts_serve_from_their_blocks_on_a_cpu(checkpoints, monkeypatch):
    """Quantized on a CPU (auto picks a quantized format for an MXFP4 checkpoint; w4a8 here), each expert's
    projections are 5-bit groups read from its blocks and scales, exactly the values stored, and never
    dequantized to floats; speculation keeps that model's tokens."""
    require(cpu_w4a8._kernel)
    float_dir, quant_dir = checkpoints
    assert resolve_quantization("auto", quant_dir, "cpu", "auto") in ("w4a8", "w8a8_int8", "int4")
    monkeypatch.setattr(mxfp4, "dequantize", lambda *a, **k: pytest.fail("an MXFP4 tensor was dequantized"))
    stored = dict(iter_weights(float_dir))
    outs = []
    for spec in ({}, {"speculative_algorithm": "NGRAM"}):
        with Engine(planner=untimed, model_path=str(quant_dir), quantization="w4a8", max_total_tokens=1024,
                    **spec) as eng:
            experts = eng.debug.target.model.get_submodule("model.layers.1.mlp.experts")
            for e in range(CONFIG["num_local_experts"]):
                gate_up = stored["model.layers.1.mlp.experts.gate_up_proj"][e].T
                down = stored["model.layers.1.mlp.experts.down_proj"][e].T
                assert type(experts[e].gate_up_proj) is type(experts[e].down_proj) is Q5Linear
                assert torch.equal(experts[e].gate_up_proj.dequantized(), torch.cat([gate_up[0::2], gate_up[1::2]]))
                assert torch.equal(experts[e].down_proj.dequantized(), down)
            outs.append([o["output_ids"] for o in eng.generate(input_ids=prompts()[:3], sampling_params=GREEDY)])
    assert outs[1] == outs[0]


def test_sinks_and_experts_under_tensor_parallelism(checkpoints):
    """Two ranks, each with half the heads (their sinks) and half of every expert's units."""
    float_dir, _ = checkpoints
    outs = {}
    for tp in (1, 2):
        with Engine(planner=untimed, model_path=str(float_dir), dtype="float32", max_total_tokens=4096,
                    tp_size=tp) as eng:
            outs[tp] = [o["output_ids"] for o in eng.generate(input_ids=prompts(), sampling_params=GREEDY)]
    assert outs[2] == outs[1]


def test_a_gpt_oss_gguf_reads_as_llama_cpp_reads_it(tmp_path, monkeypatch):
    """Its header's yarn RoPE (which transformers' reader misreads) with the correction range rounded
    outwards (no key says otherwise), its tokenizer, and its MXFP4 experts exactly; a damaged exponent
    (weights past 2^120) is refused."""
    monkeypatch.setenv("SPEC_CACHE_DIR", str(tmp_path / "cache"))
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0,
            "original_max_position_embeddings": 64}
    tokenizer = gguf_tokenizer()
    source = make_model(tmp_path / "hf", "gpt_oss", layers=2, vocab=len(tokenizer), rope_parameters=rope,
                        num_local_experts=4, num_experts_per_tok=2)
    path = tmp_path / "tiny-gpt-oss.gguf"
    mxfp4_experts = dict.fromkeys(("gate_proj", "up_proj", "down_proj"), "MXFP4")
    write_tiny_gguf(path, AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32), tokenizer, mxfp4_experts)
    assert load_config(convert_gguf(path)).rope_parameters == rope
    assert load_tokenizer(path)(TEXTS[0]).input_ids == tokenizer(TEXTS[0]).input_ids

    import gguf

    reader = gguf.GGUFReader(path)
    down = next(t for t in reader.tensors if t.name == "blk.0.ffn_down_exps.weight")
    stored = dict(iter_weights(convert_gguf(path)))["model.layers.0.mlp.experts.1.down_proj.weight"]
    assert torch.equal(stored, torch.from_numpy(gguf.dequantize(down.data, down.tensor_type)[1]))
    with pytest.raises(ValueError, match="exponent is 248.*damaged"):
        gguf_quant.decode(np.full((1, 17), 248, np.uint8), "MXFP4", 1)
