"""Engine options that turn on each speculative algorithm for a tiny target, its draft built where it
needs one: shared by the tests of every algorithm (and by the GPU tests, whose machine has no scipy)."""

from __future__ import annotations

from tests.tiny import make_model

def draft_setup(algo: str, target_dir, tmp_path, vocab: int = 320) -> dict:
    """Engine kwargs that turn on `algo` for the target in target_dir, building a tiny draft if needed."""
    if algo == "NGRAM":
        return {}
    if algo == "STANDALONE":
        return {"speculative_draft_model_path": str(make_model(tmp_path / "draft", "llama", seed=7, vocab=vocab, layers=1))}
    from tests import eagle_checkpoints as eagle

    if algo == "EAGLE":
        return {"speculative_draft_model_path": str(eagle.save_eagle_repo(tmp_path / "eagle", *eagle.eagle_tensors(target_dir)))}
    if algo == "MTP":   # the target itself, with a DeepSeek-style nextn layer added to its checkpoint
        return {"model_path": str(eagle.save_mtp_target(tmp_path / "mtp", target_dir, "nextn"))}
    if algo == "EAGLE3":
        path = eagle.save_eagle3(tmp_path / "eagle3", target_dir, draft_vocab=min(200, vocab - 2), aux_layer_ids=[0, 1, 1])
        return {"speculative_draft_model_path": str(path)}
    raise AssertionError(algo)


ALGOS = ["NGRAM", "STANDALONE", "EAGLE", "EAGLE3", "MTP"]


def module_for(algo: str) -> str:
    return {"NGRAM": "engine.speculative.ngram", "STANDALONE": "engine.speculative.standalone"}.get(
        algo, "engine.speculative.eagle")
