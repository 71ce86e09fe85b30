"""How a model is split over the tensor-parallel ranks: Megatron-style, the split SGLang's parallel
layers make, applied to the same modules for targets and drafts (EAGLE, EAGLE-3, MTP, STANDALONE).

- q/k/v and gate/up projections: column-parallel, each rank holds a block of the heads (of the MLP's
  units): a block of the weight's rows, and of the bias; attention sinks (a logit per head) likewise.
- o_proj and down_proj: row-parallel, the matching block of input columns; their outputs are partial
  sums, all-reduced after the attention and after the MLP (group.all_reduce). A bias is added once:
  rank 0 keeps it, the others hold zeros.
- embed_tokens and lm_head (the target's, a STANDALONE draft's, EAGLE-3's own head): vocabulary-parallel,
  ceil(V / N) rows each, the last block padded with zero rows (group.embed, group.gather_vocab).
- everything else (norms, EAGLE's fc, MTP's projection, EAGLE-3's d2t, rotary tables): replicated.

A model is built at its local sizes from `local_config` and reads only its block of each checkpoint
tensor as the tensors stream in (`local_weights`, `local_groups` for a GGUF's own groups), so no rank
ever holds the whole model. Quantizing (int4, w8a8_int8) and prepacking happen as the blocks load, on the local blocks.
"""

from __future__ import annotations

import copy
from typing import Callable, Iterable, Iterator, Optional

import torch

from engine.distributed import group
from engine.errors import ConfigError
from engine.loader.gguf_quant import Groups

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
VOCAB = ("embed_tokens", "lm_head")


def _size() -> int:
    g = group.building()
    return g.size if g else 1


def local_rows(rows: int, n: Optional[int] = None) -> int:
    """Rows of a vocabulary-parallel weight each of n ranks (those building now) holds."""
    return -(-rows // (n or _size()))


def local_config(config, what: str = "the model"):
    """A copy of a transformers config whose sizes are one rank's: the model built from it is this
    rank's block. The config itself is returned when there is one rank."""
    n = _size()
    if n == 1:
        return config
    if getattr(config, "kv_lora_rank", None):
        raise ConfigError(f"--tp-size {n}: {what} uses DeepSeek's MLA attention and mixture of experts, which are "
                          "not sharded yet; serve it with --tp-size 1.")
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    sizes = {"attention heads": heads, "key/value heads": kv_heads, "MLP units (intermediate_size)": config.intermediate_size}
    for name, value in sizes.items():
        if value % n:
            raise ConfigError(f"--tp-size {n} must divide {what}'s {name} ({value}); pick a --tp-size that does.")
    local = copy.deepcopy(config)
    local.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    local.num_attention_heads, local.num_key_value_heads = heads // n, kv_heads // n
    local.intermediate_size = config.intermediate_size // n
    local.vocab_size = local_rows(config.vocab_size)
    return local


def local_block(name: str, tensor: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """This rank's block of the checkpoint tensor `name` (the tensor itself when replicated)."""
    parts = name.split(".")
    module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
    if module in COLUMN:
        return _block(tensor, 0, rank, n)
    if module in ROW:
        if kind == "bias":
            return tensor if rank == 0 else torch.zeros_like(tensor)
        return _block(tensor, 1, rank, n)
    if kind == "sinks":             # GPT-OSS's sink logit per query head: this rank's heads'
        return _block(tensor, 0, rank, n)
    if module in VOCAB and kind == "weight":
        rows = local_rows(tensor.shape[0], n)
        block = tensor[rank * rows:(rank + 1) * rows]
        return torch.cat([block, block.new_zeros((rows - block.shape[0], *block.shape[1:]))]) if len(block) < rows \
            else block.clone()
    return tensor


def _block(tensor: torch.Tensor, dim: int, rank: int, n: int) -> torch.Tensor:
    size = tensor.shape[dim] // n
    return tensor.narrow(dim, rank * size, size).clone()     # a copy: the full tensor can be freed


def local_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) stream with each tensor cut to this rank's block."""
    g = group.building()
    if g is None:
        yield from weights
        return
    for name, tensor in weights:
        tensor = local_block(name, tensor, g.rank, g.size)
        yield name, tensor
        del tensor                          # not held while the next one is read


Lookup = Callable[[str], Optional[Groups]]


def local_groups(groups: Lookup) -> Lookup:
    """A GGUF's own groups (gguf_quant.Groups, engine/models/quant.py install_gguf_groups) cut to this
    rank's block: rows for column-parallel parts and for the vocabulary-parallel head (padded with zero
    rows), whole groups of input columns for row-parallel ones (of 32, or Q6_K's 256: every tensor's
    columns follow the input's; a layer whose block is no whole number of them stays dense, loaded from
    its float copy)."""
    g = group.building()
    if g is None:
        return groups

    def local(name: str) -> Optional[Groups]:
        found = groups(name)
        module = name.split(".")[-2]
        if found is None or module not in COLUMN + ROW + VOCAB:
            return found
        if module in COLUMN:
            return found.map(lambda t: _block(t, 0, g.rank, g.size))
        if module in VOCAB:
            return found.map(lambda t: local_block(name, t, g.rank, g.size))
        if any(t.shape[1] % g.size for t in found[1:] if t is not None):
            return None
        return found.map(lambda t: _block(t, 1, g.rank, g.size))

    return local
