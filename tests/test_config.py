"""ServerArgs: defaults, auto choices and every bad combination caught before any weight loads."""

import json

import pytest

from engine.config import ServerArgs
from engine.errors import ConfigError


def model_config(model_type="llama", max_pos=2048, **extra):
    from types import SimpleNamespace

    return SimpleNamespace(model_type=model_type, max_position_embeddings=max_pos, **extra)


def test_auto_tree_depends_on_the_device_and_on_a_gpu_on_the_target_family():
    args = ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path="d")
    llama = args.resolved(model_config("llama", 2048), "cuda")
    assert llama.speculative_tree == (5, 4, 8) and llama.context_length == 2048
    assert args.speculative_tree == (None, None, None) and args.context_length is None    # unchanged
    qwen = args.resolved(model_config("qwen2", 4096), "cuda")
    assert qwen.speculative_tree == (3, 1, 4)
    # A CPU's verify cost grows with every token: one draft step, 3 tokens, whatever the family.
    for family in ("llama", "qwen2"):
        assert args.resolved(model_config(family), "cpu").speculative_tree == (1, 2, 3)
    given = ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="d", speculative_num_steps=5,
                       speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    assert given.resolved(model_config("llama"), "cpu").speculative_tree == (5, 4, 8)


def test_ngram_tree_is_sized_as_sglang_sizes_it():
    """NGRAM's branching is --speculative-ngram-max-bfs-breadth and its size the max match window when
    left out; the draft tokens may be given alone (SGLang's NGRAM example)."""
    assert ServerArgs(speculative_algorithm="NGRAM").speculative_tree == (11, 10, 12)
    assert ServerArgs(speculative_algorithm="NGRAM", speculative_ngram_max_bfs_breadth=1).speculative_tree == (11, 1, 12)
    assert ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=16).speculative_tree == (15, 10, 16)
    assert ServerArgs(speculative_algorithm="NGRAM", speculative_num_steps=3,
                      speculative_eagle_topk=1).speculative_tree == (3, 1, 4)
    # On a CPU, where each verified token costs, the tree left out verifies 4 tokens; one flag given keeps
    # SGLang's sizing there too.
    resolve = lambda device, **kw: ServerArgs(speculative_algorithm="NGRAM", **kw).resolved(  # noqa: E731
        model_config("llama"), device).speculative_tree
    assert resolve("cuda") == (11, 10, 12) and resolve("cpu") == (3, 10, 4)
    assert resolve("cpu", speculative_ngram_max_bfs_breadth=1) == (3, 1, 4)
    assert resolve("cpu", speculative_num_draft_tokens=12) == (11, 10, 12)


@pytest.mark.parametrize("tree", [(3, 4, 16), (5, 8, 32), (5, 8, 64), (2, 3, 13), (4, 1, 5)])
def test_trees_up_to_what_the_search_ranks_are_accepted(tree):
    """EAGLE-2 ranks topk + (steps-1)*topk^2 candidates: SGLang's guide trees fit, and the largest too."""
    steps, topk, tokens = tree
    args = ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="d", speculative_num_steps=steps,
                      speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens)
    assert args.speculative_tree == tree


def test_eagle_without_a_draft_uses_the_targets_mtp_layers():
    args = ServerArgs(speculative_algorithm="EAGLE")          # the flags alone cannot tell: accepted
    mimo = args.resolved(model_config("mimo", num_nextn_predict_layers=1), "cuda")
    assert mimo.speculative_algorithm == "MTP" and mimo.speculative_tree == (3, 1, 4)
    with pytest.raises(ConfigError, match="needs a draft model.*has none"):
        args.resolved(model_config("qwen2"), "cpu")
    with_draft = ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="d")
    assert with_draft.resolved(model_config("mimo", num_nextn_predict_layers=1), "cpu").speculative_algorithm == "EAGLE"


def test_server_args_are_immutable():
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        ServerArgs().port = 1


def test_nextn_is_mtp_and_case_insensitive():
    assert ServerArgs(speculative_algorithm="nextn").speculative_algorithm == "MTP"
    assert ServerArgs(speculative_algorithm="ngram").speculative_algorithm == "NGRAM"


@pytest.mark.parametrize("kwargs, message", [
    ({"speculative_algorithm": "EAGLE3"}, "needs a draft model.*MTP layers lack"),
    ({"speculative_algorithm": "STANDALONE"}, "needs a draft model"),
    ({"speculative_algorithm": "MEDUSA"}, "Unknown --speculative-algorithm"),
    ({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "d", "speculative_num_steps": 3}, "together"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 3, "speculative_eagle_topk": 2,
      "speculative_num_draft_tokens": 12}, "can hold: at most topk \\+ \\(steps-1\\)\\*topk\\^2 \\+ 1 = 11"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 300}, "far past"),
    ({"speculative_algorithm": "NGRAM", "speculative_token_map": "m.pt"}, "drop --speculative-token-map"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
      "speculative_num_draft_tokens": 3}, "must be steps \\+ 1 = 4"),
    ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "x"}, "takes no draft model"),
    ({"speculative_algorithm": "NGRAM", "speculative_sampling": "rejection"}, "deterministic"),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "d", "speculative_num_steps": 2,
      "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 4, "speculative_sampling": "rejection"}, "chains"),
    ({"speculative_num_steps": 3}, "without --speculative-algorithm"),
    ({"mem_fraction_static": 1.5}, "mem-fraction-static"),
    ({"max_running_requests": 0}, "positive integer"),
    ({"dtype": "int8"}, "must be one of"),
    ({"chunked_prefill_size": -5}, "chunked-prefill-size"),
    ({"enable_multi_layer_eagle": True}, "without --speculative-algorithm"),
    ({"enable_multi_layer_eagle": True, "speculative_algorithm": "NGRAM"}, "EAGLE without a draft model.*or MTP"),
    ({"enable_multi_layer_eagle": True, "speculative_algorithm": "EAGLE", "speculative_draft_model_path": "d"},
     "several MTP layers"),
    ({"enable_multi_layer_eagle": True, "speculative_algorithm": "MTP", "speculative_num_steps": 3,
      "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6}, "drafts a chain"),
    ({"enable_overlap_schedule": True}, "no overlap scheduler.*Drop the flag"),
])
def test_bad_flags_are_clear_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ServerArgs(**kwargs)


def test_from_dict_accepts_flags_and_aliases_and_rejects_unknown(tmp_path):
    args = ServerArgs.from_dict({"--model": "m", "algo": "NGRAM", "mem-fraction": 0.5})
    assert (args.model_path, args.speculative_algorithm, args.mem_fraction_static) == ("m", "NGRAM", 0.5)
    with pytest.raises(ConfigError, match="Unknown option 'speculative-foo'"):
        ServerArgs.from_dict({"speculative-foo": 1})
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"speculative-algorithm": "NGRAM", "port": 1234}))
    assert ServerArgs.from_file(cfg, port=4321).port == 4321
    (tmp_path / "bad.yaml").write_text("port: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        ServerArgs.from_file(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        ServerArgs.from_file(tmp_path / "missing.yaml")


@pytest.mark.parametrize("flags, message", [
    ({"tp_size": 0}, "--tp-size must be a positive integer"),
    ({"tp_size": 3, "nnodes": 2, "dist_init_addr": "h:1"}, "--tp-size 3 must be a multiple of --nnodes 2"),
    ({"tp_size": 2, "nnodes": 2}, "--nnodes > 1 needs --dist-init-addr"),
    ({"nnodes": 2, "node_rank": 2, "tp_size": 2, "dist_init_addr": "h:1"}, "--node-rank must be in 0..1"),
    ({"dist_init_addr": "10.0.0.1"}, "--dist-init-addr must be HOST:PORT"),
    ({"dp_size": 2, "nnodes": 2, "tp_size": 2, "dist_init_addr": "h:1"}, "one `spec serve` per machine"),
    ({"router_policy": "round_robin"}, "--router-policy chooses among --dp-size replicas"),
    ({"tp_size": 2, "speculative_algorithm": "EAGLE", "speculative_draft_model_path": "d",
      "speculative_token_map": "m.pt"}, "--speculative-token-map cannot be used with --tp-size > 1"),
])
def test_parallelism_flags_are_checked_before_anything_starts(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("`", ".")):
        ServerArgs(**flags)


def test_sglang_parallelism_spellings():
    args = ServerArgs.from_dict({"--tp": 2, "tensor_parallel_size": 2, "--dp": 3, "data-parallel-size": 3})
    assert (args.tp_size, args.dp_size, args.ranks_per_node) == (2, 3, 2)
    assert ServerArgs(tp_size=4, nnodes=2, dist_init_addr="10.0.0.1:5000").ranks_per_node == 2
