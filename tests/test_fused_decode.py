"""Decode steps with one C call per layer (engine/models/fused_decode.py) give the eager layers' bits."""

from __future__ import annotations

import pytest
import torch

import engine.core.model_runner as model_runner
from engine.models import fused_decode
from spec_kernels import cpu_decoder
from tests.compiler import needs_compiler
from tests.lossless import prompts as lossless_prompts
from tests.tiny import make_model, tiny_engine

pytestmark = needs_compiler
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


def forwards(model_dir, monkeypatch, fused: bool):
    """Every target forward's final hidden states and the number of fused layer calls."""
    seen, calls = [], [0]
    forward, run = model_runner.ModelRunner.forward, cpu_decoder.run

    def recording_forward(self, batch, *args, **kwargs):
        out = forward(self, batch, *args, **kwargs)
        seen.append(out.hidden.clone())
        return out

    def counting_run(*args):
        calls[0] += 1
        return run(*args)

    monkeypatch.setattr(model_runner.ModelRunner, "forward", recording_forward)
    monkeypatch.setattr(cpu_decoder, "run", counting_run)
    if not fused:
        monkeypatch.setattr(fused_decode, "plan", lambda *args: None)
    eng = tiny_engine(model_dir, "NGRAM", tree=(3, 2, 6), quantization="w4a8", dtype="bfloat16")
    outputs = [o["output_ids"] for o in eng.generate(input_ids=lossless_prompts(), sampling_params=GREEDY)]
    stats = eng.stats()
    eng.shutdown()
    monkeypatch.undo()
    return seen, outputs, calls[0], stats


@pytest.mark.parametrize("arch", ["llama", "qwen2",       # qwen2: q/k/v biases
                                  "gguf"])              # K quants, q/k/v in Q4_K and Q6_K chained
def test_fused_layers_give_the_eager_layers_bits(arch, tmp_path, monkeypatch):
    if arch == "gguf":
        from engine.loader import convert_gguf
        from tests.gguf_files import gguf_tokenizer, tiny_llama, write_tiny_gguf

        monkeypatch.setenv("SPEC_CACHE_DIR", str(tmp_path / "cache"))
        tokenizer, model = gguf_tokenizer(), tmp_path / "tiny.gguf"
        types = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_1", "gate_proj": "Q4_K",
                 "up_proj": "Q4_K", "down_proj": "Q6_K"}
        write_tiny_gguf(model, tiny_llama(len(tokenizer), hidden_size=256, intermediate_size=512), tokenizer, types)
        model = convert_gguf(model)         # here, in this test's cache: `forwards` undoes its monkeypatching
    else:
        model = make_model(tmp_path, arch, layers=3, seed=5)
    fused, fused_out, calls, stats = forwards(model, monkeypatch, fused=True)
    eager, eager_out, none, _ = forwards(model, monkeypatch, fused=False)
    assert calls > 0 and none == 0 and stats["spec_verify_ct"] > 0     # decode and verify steps ran fused
    assert fused_out == eager_out and len(fused) == len(eager)
    for a, b in zip(fused, eager):
        assert torch.equal(a, b)


def test_models_it_cannot_run_keep_their_layers(tmp_path, monkeypatch):
    """Qwen3's q/k norms are not in the C layer; float32 is not either."""
    _, _, calls, _ = forwards(make_model(tmp_path / "q3", "qwen3"), monkeypatch, fused=True)
    assert calls == 0
