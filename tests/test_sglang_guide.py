"""SGLang's speculative decoding guide, as a user would translate it: each `python3 -m sglang.launch_server`
command line becomes `spec serve` with the same flags and environment (tiny random models stand in for the
hub ids; `--tp` is left out, one device), parses, resolves against its model and runs."""

from __future__ import annotations

import dataclasses
import shlex

import pytest
import torch
from typer.testing import CliRunner

from engine import Engine
from engine.build import resolve_args
from engine.loader import load_config
from spec_cli.main import app
from tests import eagle_checkpoints as ckpt
from tests.planning import untimed
from tests.tiny import make_deepseek, make_model

# (command line after `python3 -m sglang.launch_server`, algorithm and tree it runs with)
GUIDE = {
    "eagle2": ("--model meta-llama/Llama-2-7b-chat-hf --speculative-algorithm EAGLE "
               "--speculative-draft-model-path lmsys/sglang-EAGLE-llama2-chat-7B --speculative-num-steps 3 "
               "--speculative-eagle-topk 4 --speculative-num-draft-tokens 16 --mem-fraction-static 0.7 "
               "--cuda-graph-max-bs 8 --log-level warning", "EAGLE", (3, 4, 16)),
    "eagle2-torch-compile": ("--model meta-llama/Llama-2-7b-chat-hf --speculative-algorithm EAGLE "
                             "--speculative-draft-model-path lmsys/sglang-EAGLE-llama2-chat-7B --speculative-num-steps 5 "
                             "--speculative-eagle-topk 8 --speculative-num-draft-tokens 64 --mem-fraction 0.6 "
                             "--enable-torch-compile --torch-compile-max-bs 2", "EAGLE", (5, 8, 64)),
    "eagle2-fr-spec": ("--model meta-llama/Meta-Llama-3-8B-Instruct --speculative-algorithm EAGLE "
                       "--speculative-draft-model-path lmsys/sglang-EAGLE-LLaMA3-Instruct-8B --speculative-num-steps 5 "
                       "--speculative-eagle-topk 8 --speculative-num-draft-tokens 64 "
                       "--speculative-token-map thunlp/LLaMA3-Instruct-8B-FR-Spec/freq_32768.pt "
                       "--mem-fraction 0.7 --cuda-graph-max-bs 2 --dtype float16", "EAGLE", (5, 8, 64)),
    "eagle3": ("--model meta-llama/Llama-3.1-8B-Instruct --speculative-algorithm EAGLE3 "
               "--speculative-draft-model-path jamesliu1/sglang-EAGLE3-Llama-3.1-Instruct-8B --speculative-num-steps 5 "
               "--speculative-eagle-topk 8 --speculative-num-draft-tokens 32 --mem-fraction 0.6 "
               "--cuda-graph-max-bs 2 --dtype float16", "EAGLE3", (5, 8, 32)),
    "mtp-mimo": ("--model XiaomiMiMo/MiMo-7B-RL --host 0.0.0.0 --trust-remote-code --speculative-algorithm EAGLE "
                 "--speculative-num-steps 1 --speculative-eagle-topk 1 --speculative-num-draft-tokens 2 "
                 "--mem-fraction-static 0.7 --cuda-graph-max-bs 8 --log-level warning", "MTP", (1, 1, 2)),
    "mtp-deepseek": ("--model-path deepseek-ai/DeepSeek-V3-0324 --speculative-algorithm EAGLE --speculative-num-steps 1 "
                     "--speculative-eagle-topk 1 --speculative-num-draft-tokens 2 --trust-remote-code", "MTP", (1, 1, 2)),
    "nextn-draft": ("--model-path deepseek-ai/DeepSeek-V3-0324 --speculative-algo NEXTN "
                    "--speculative-draft lmsys/DeepSeek-V3-0324-NextN --speculative-num-steps 3 "
                    "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4", "MTP", (3, 1, 4)),
    "standalone": ("--model Qwen/Qwen2.5-7B-Instruct --speculative-algorithm STANDALONE "
                   "--speculative-draft-model-path Qwen/Qwen2.5-1.5B-Instruct --speculative-num-steps 4 "
                   "--speculative-eagle-topk 2 --speculative-num-draft-tokens 7 --mem-fraction-static 0.7 "
                   "--cuda-graph-max-bs 8 --log-level warning", "STANDALONE", (4, 2, 7)),
    # Run with SGLANG_ENABLE_SPEC_V2=True, as the guide writes it: SGLang's environment, which spec ignores.
    "spec-v2-standalone": ("--model Qwen/Qwen2.5-7B-Instruct --speculative-algorithm STANDALONE "
                           "--speculative-draft-model-path Qwen/Qwen2.5-1.5B-Instruct --speculative-num-steps 4 "
                           "--speculative-eagle-topk 1 --speculative-num-draft-tokens 5 --mem-fraction-static 0.7 "
                           "--cuda-graph-max-bs 8 --log-level warning", "STANDALONE", (4, 1, 5)),
    "ngram": ("--model Qwen/Qwen2.5-7B-Instruct --speculative-algorithm NGRAM --speculative-num-draft-tokens 16 "
              "--speculative-ngram-max-match-window-size 12 --speculative-ngram-max-bfs-breadth 10 "
              "--mem-fraction-static 0.7 --cuda-graph-max-bs 8 --log-level warning", "NGRAM", (15, 10, 16)),
    "oom-recipe": ("--model meta-llama/Llama-2-7b-chat-hf --speculative-algorithm EAGLE "
                   "--speculative-draft-model-path lmsys/sglang-EAGLE-llama2-chat-7B --speculative-num-steps 3 "
                   "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4 --cuda-graph-max-bs 2 "
                   "--mem-fraction-static 0.5 --max-running-requests 4 --log-level warning", "EAGLE", (3, 1, 4)),
}


@pytest.fixture(scope="module")
def hub(tmp_path_factory, target):
    """Hub id -> a tiny stand-in of the same kind."""
    root = tmp_path_factory.mktemp("hub")
    qwen = make_model(root / "qwen", "qwen2")
    deepseek = ckpt.save_mtp_target(root / "deepseek", make_deepseek(root / "deepseek-base"), "nextn")
    eagle = ckpt.save_sglang_eagle(root / "eagle", target, *ckpt.eagle_tensors(target))
    return {
        "meta-llama/Llama-2-7b-chat-hf": target, "meta-llama/Meta-Llama-3-8B-Instruct": target,
        "meta-llama/Llama-3.1-8B-Instruct": target,
        "lmsys/sglang-EAGLE-llama2-chat-7B": eagle, "lmsys/sglang-EAGLE-LLaMA3-Instruct-8B": eagle,
        "jamesliu1/sglang-EAGLE3-Llama-3.1-Instruct-8B": ckpt.save_eagle3(root / "eagle3", target),
        "XiaomiMiMo/MiMo-7B-RL": ckpt.save_mtp_target(root / "mimo", make_model(root / "mimo-base", "qwen2"), "mimo"),
        "deepseek-ai/DeepSeek-V3-0324": deepseek,
        "lmsys/DeepSeek-V3-0324-NextN": ckpt.save_nextn_export(root / "nextn", deepseek),
        "Qwen/Qwen2.5-7B-Instruct": qwen, "Qwen/Qwen2.5-1.5B-Instruct": make_model(root / "qwen-draft", "qwen2", seed=7),
    }


@pytest.fixture
def fr_spec_map(tmp_path, monkeypatch):
    """The hub's copy of thunlp's FR-Spec map, as its local cache would hand it out."""
    import huggingface_hub

    path = tmp_path / "freq_32768.pt"
    torch.save(list(range(3, 200)), path)
    files = {("thunlp/LLaMA3-Instruct-8B-FR-Spec", "freq_32768.pt"): str(path)}
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, name, **kw: files[repo, name])


@pytest.mark.parametrize("name", GUIDE)
def test_guide_command_lines_parse_resolve_and_run(name, hub, served, fr_spec_map, monkeypatch):
    line, algorithm, tree = GUIDE[name]
    if name.startswith("spec-v2"):
        monkeypatch.setenv("SGLANG_ENABLE_SPEC_V2", "True")
    args = shlex.split(line)
    result = CliRunner().invoke(app, ["serve", *(str(hub.get(a, a)) for a in args)], prog_name="spec")
    assert result.exit_code == 0, result.output
    [parsed] = served
    config = load_config(parsed.model_path, parsed.trust_remote_code)
    resolved = resolve_args(parsed, config, "cuda")      # the guide's auto trees are a GPU's (a CPU's: test_config)
    assert (resolved.speculative_algorithm, resolved.speculative_tree) == (algorithm, tree)
    # The guide's memory flags size a GPU; a small pool runs the same configuration here.
    eng = Engine(planner=untimed, server_args=dataclasses.replace(parsed, max_total_tokens=2048))
    out = eng.generate(input_ids=list(range(10, 30)),
                       sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
    assert len(out["output_ids"]) == 8 and out["meta_info"]["spec_verify_ct"] > 0
