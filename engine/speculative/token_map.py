"""FR-Spec token maps: a draft's lm_head restricted to the most frequent tokens.

With a large vocabulary the lm_head is a big share of a small draft's cost. FR-Spec (Zhao et al., 2025)
drafts over the few thousand most frequent tokens only: acceptance barely moves, since drafts are
almost always frequent tokens, and verification keeps the output exact whatever the draft proposes.
A map is a torch.save'd list (or 1-D tensor) of token ids ordered by frequency, as FR-Spec publishes.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from engine.distributed import group as tp
from engine.errors import ConfigError

_FORMAT = "a file written by torch.save(token_ids, path), token_ids a list or 1-D tensor of distinct ints"


def resolve_token_map(path: str) -> str:
    """A local file for --speculative-token-map: the path itself, or for a hub-style path that is no local
    file, `org/repo/file.pt` (SGLang's guide passes thunlp/LLaMA3-Instruct-8B-FR-Spec/freq_32768.pt), the
    file from the Hugging Face hub, its local cache first. Checked before any weight loads."""
    local = Path(path).expanduser()
    if local.is_file():
        return str(local)
    where = f"--speculative-token-map {path!r}"
    parts = path.split("/")
    if path.startswith(("/", ".", "~")) or len(parts) < 3 or local.parent.is_dir():
        raise ConfigError(f"{where} does not exist; pass {_FORMAT} (FR-Spec's freq_*.pt files are such), or a "
                          "hub path org/repo/file.pt.")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    repo, filename = "/".join(parts[:2]), "/".join(parts[2:])
    try:
        try:
            return hf_hub_download(repo, filename, local_files_only=True)
        except LocalEntryNotFoundError:
            return hf_hub_download(repo, filename)
    except Exception as exc:  # no such repo or file; offline (LocalEntryNotFoundError), HTTP and connection errors
        missing = isinstance(exc, (EntryNotFoundError, RepositoryNotFoundError))
        if missing and not isinstance(exc, LocalEntryNotFoundError):
            raise ConfigError(f"{where} is no local file, and the Hugging Face hub has no file {filename!r} in a "
                              f"repo {repo!r} ({type(exc).__name__}); pass a local file or an existing "
                              "org/repo/file path.") from None
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{where} is no local file, and the Hugging Face hub is unreachable ({reason}) with "
                          f"the file not in its local cache. Where the hub is reachable run `hf download {repo} "
                          f"{filename} --local-dir DIR`, then pass DIR/{filename}.") from None


def load_token_map(path: str | Path, vocab_size: int) -> torch.LongTensor:
    """The map's token ids, validated against the draft vocabulary [0, vocab_size)."""
    where = f"--speculative-token-map {str(path)!r}"
    if not Path(path).is_file():
        raise ConfigError(f"{where} does not exist; pass {_FORMAT} (FR-Spec's freq_*.pt files are such).")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # unpickling raises many types
        raise ConfigError(f"{where} cannot be read by torch.load ({exc}); pass {_FORMAT}.") from None
    if isinstance(data, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in data):
        ids = torch.tensor(data, dtype=torch.long)
    elif isinstance(data, torch.Tensor) and not data.is_floating_point() and not data.is_complex() \
            and data.dtype != torch.bool:
        ids = data.long()
    else:
        raise ConfigError(f"{where} holds {_describe(data)}; pass {_FORMAT}.")
    if ids.dim() != 1 or ids.numel() == 0:
        raise ConfigError(f"{where} holds a tensor of shape {tuple(ids.shape)}; pass {_FORMAT} (1-D, not empty).")
    outside = ids[(ids < 0) | (ids >= vocab_size)]
    if outside.numel():
        raise ConfigError(f"{where} lists token id {int(outside[0])}, outside the vocabulary [0, {vocab_size}); "
                          "pass a map made for this model's tokenizer.")
    values, counts = ids.unique(return_counts=True)
    if (counts > 1).any():
        raise ConfigError(f"{where} lists token id {int(values[counts > 1][0])} more than once; each id must "
                          "appear once.")
    return ids


def _describe(data) -> str:
    if isinstance(data, torch.Tensor):
        return f"a {data.dtype} tensor"
    if isinstance(data, (list, tuple)):
        return "a list with non-integer items"
    return f"a {type(data).__name__}"


class HotVocabHead:
    """A draft lm_head over the map's tokens: one matmul with their rows of the lm_head weight, scattered
    into logits over the full vocabulary with -inf elsewhere, so any top-k or sampling picks hot tokens."""

    def __init__(self, weight: torch.Tensor, hot_ids: torch.Tensor, vocab_size: int, dtype: torch.dtype):
        """`weight`: the full lm_head's (a quantized head's come dequantized to fp32); its hot rows are
        kept in `dtype`, the hidden states'."""
        ids = hot_ids.to(weight.device)
        # A contiguous copy of the hot rows; no tensor-parallel group (FR-Spec maps are refused under
        # tensor parallelism: engine/config.py).
        self._use(weight.detach()[ids].to(dtype), ids, vocab_size, None)

    def _use(self, rows: torch.Tensor, ids: torch.Tensor, vocab_size: int, tp_group) -> None:
        """Logits of target tokens `ids` from the weight `rows` (this rank's block of them under `tp_group`)."""
        self.weight, self.ids, self.vocab_size, self.tp = rows, ids, vocab_size, tp_group
        self.matmul: Callable[[torch.Tensor], torch.Tensor] = functools.partial(F.linear, weight=rows)

    def quantize(self, kind: type) -> None:
        """Run the rows through `kind` (a quantized linear class) instead: a draft head's matmul reads as
        many bytes as a decoder layer's, every draft step. Drafts never change the output."""
        self.matmul, self.weight = kind.quantize(self.weight, None), None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] final normed hidden states -> fp32 logits [N, vocab_size]."""
        # Sharded (EAGLE-3's own head under tensor parallelism): the rows are this rank's block of them.
        hot = tp.gather_vocab(self.matmul(hidden).float(), len(self.ids), self.tp)
        out = hot.new_full((hot.shape[0], self.vocab_size), float("-inf"))
        return out.index_copy_(1, self.ids, hot)
