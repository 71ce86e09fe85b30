"""ServerArgs: defaults, auto choices and every bad combination caught before any weight loads."""

import json

import pytest

from engine.config import ServerArgs
from engine.errors import ConfigError


def test_auto_tree_depends_on_target_family():
    args = ServerArgs(speculative_algorithm="NGRAM")
    llama = args.resolved("llama", 2048)
    assert llama.speculative_tree == (5, 4, 8) and llama.context_length == 2048
    assert args.speculative_tree == (None, None, None) and args.context_length is None    # unchanged
    qwen = args.resolved("qwen2", 4096)
    assert qwen.speculative_tree == (3, 1, 4)


def test_server_args_are_immutable():
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        ServerArgs().port = 1


def test_nextn_is_mtp_and_case_insensitive():
    assert ServerArgs(speculative_algorithm="nextn").speculative_algorithm == "MTP"
    assert ServerArgs(speculative_algorithm="ngram").speculative_algorithm == "NGRAM"


@pytest.mark.parametrize("kwargs, message", [
    ({"speculative_algorithm": "EAGLE"}, "needs a draft model"),
    ({"speculative_algorithm": "MEDUSA"}, "Unknown --speculative-algorithm"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 3}, "together"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 3, "speculative_eagle_topk": 2,
      "speculative_num_draft_tokens": 8}, "at most steps\\*topk \\+ 1 = 7"),
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
