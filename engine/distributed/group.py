"""This process's tensor-parallel rank and the collectives the models call.

One process per rank. `init` joins the group through torch.distributed's TCP rendezvous: gloo on CPU,
NCCL on a GPU for the models' tensors, plus a gloo group that carries rank 0's per-forward messages
(mirror.py). Modules built inside `sharded` keep the group and pass it to the collectives; a module
built without one (--tp-size 1) gets its input back from every function here: the single-process path
runs no collective.

Sharded layers produce partial sums (attention's and the MLP's output projections) or a slice of the
vocabulary (embedding rows, lm_head rows); `all_reduce`, `embed` and `gather_vocab` make them whole, so
every rank holds the same hidden states and the same full logits.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from engine.errors import DistributedError

# Followers wait for rank 0's next message as long as the server is idle; a rank that dies closes its
# sockets, which ends the wait at once (launch.py), so this only has to outlast idleness.
IDLE_TIMEOUT = datetime.timedelta(days=3650)


@dataclass(frozen=True)
class Group:
    rank: int
    size: int
    device: str                    # "cpu" or "cuda"
    messages: dist.ProcessGroup    # gloo: rank 0's pickled messages


_group: Optional[Group] = None       # the group this process joined
_building: Optional[Group] = None    # the group the models built now are sharded over (`sharded`)


def init(rank: int, size: int, addr: str, device: str, timeout_s: int,
         failed: Callable[[], Optional[str]] = lambda: None) -> Group:
    """Join the group of `size` ranks meeting at addr (HOST:PORT, rank 0's rendezvous store), waiting
    at most timeout_s for the others; `failed()` names a rank that died meanwhile, which ends the wait."""
    global _group
    timeout = datetime.timedelta(seconds=timeout_s)
    host, port = addr.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    # Every rank checks in, then the group is made: by then no rank is missing, so it forms at once.
    store.set(f"spec/joined/{rank}", "1")
    keys = [f"spec/joined/{r}" for r in range(size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        why = failed() or (time.monotonic() > deadline and
                           f"the {size} ranks did not all meet at {addr} within --dist-timeout {timeout_s} s")
        if why:
            raise DistributedError(f"tensor parallelism could not start: {why}")
        time.sleep(0.05)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=rank, world_size=size,
                            timeout=timeout)
    _group = Group(rank, size, device, dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT))
    return _group


def destroy() -> None:
    global _group
    if _group is not None:
        _group = None
        dist.destroy_process_group()


def joined() -> Optional[Group]:
    return _group


@contextlib.contextmanager
def sharded(on: bool):
    """Models built inside are this process's block of the group's (sharding.py), and keep the group
    for their collectives (`building`); outside, or with `on` false, models are whole. A process that
    joined a group may still build a whole model (a --tp-size 1 Engine beside a sharded one)."""
    global _building
    _building = _group if on else None
    try:
        yield
    finally:
        _building = None


def building() -> Optional[Group]:
    """The group a module built now is sharded over, or None; modules keep it for their forwards."""
    return _building


def all_reduce(x: torch.Tensor, g: Optional[Group]) -> torch.Tensor:
    """Sum a row-parallel layer's partial outputs over the ranks of g (in place)."""
    if g is not None:
        dist.all_reduce(x)
    return x


def embed(embedding: nn.Module, ids: torch.Tensor, g: Optional[Group]) -> torch.Tensor:
    """A vocabulary-parallel lookup: each rank holds a contiguous block of the rows, looks up the ids
    in it and zeroes the others; the sum over the ranks is every id's row, exactly."""
    if g is None:
        return embedding(ids)
    rows = embedding.num_embeddings
    local = ids - g.rank * rows
    inside = (local >= 0) & (local < rows)
    out = embedding(torch.where(inside, local, 0)).masked_fill(~inside[..., None], 0)
    return all_reduce(out, g)


def gather_vocab(logits: torch.Tensor, vocab_size: int, g: Optional[Group]) -> torch.Tensor:
    """Logits over every rank's block of the vocabulary [R, vocab_size] from this rank's [R, rows]."""
    if g is None:
        return logits
    parts = [torch.empty_like(logits) for _ in range(g.size)]
    dist.all_gather(parts, logits.contiguous())
    return torch.cat(parts, dim=-1)[..., :vocab_size]


def agree_min(value: int) -> int:
    """The smallest of the values the ranks building now pass (they size their KV pools alike)."""
    if _building is None:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_building.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
