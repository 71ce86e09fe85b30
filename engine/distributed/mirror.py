"""Rank 0 decides, the other ranks compute: how a tensor-parallel engine stays in step.

Rank 0 runs the Engine as on one device: the scheduler, the KV bookkeeping, sampling, verification,
the draft-tree search, grammars and n-gram caches exist there only. What needs every rank is a model
forward over sharded weights, so each one rank 0 runs is announced first (`Leader`): the target's
(`ModelRunner.forward`) and a model drafter's (`ModelDrafter.feed`, `.scores`), which call the leader
they are given before computing, with their inputs: the ForwardBatch's
tensors, the rows of the request-to-token table it reads, and the hidden states a draft forward takes.
Every other rank (`Follower`) receives the message and runs the same forward on its block of the
weights, its K/V pool holding its block of the heads at the same slots; the collectives inside the
forward (engine/distributed/group.py) make the hidden states and logits whole on every rank. Followers
return nothing and decide nothing, so no rank can diverge from rank 0's outputs. A target with a window
pool (engine/memory/window_pool.py) has its slot map's entries for every slot a forward reads or writes
sent with it: rank 0 alone hands out and frees window slots, and each rank's map is right wherever its
forwards look.

A message is a pickled header on the gloo message group, then at most three tensors (the integers
packed in one, the tree mask, the hidden states) on the model's group (NCCL on a GPU).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from engine.distributed import group
from engine.distributed.group import Group
from engine.errors import DistributedError, SpecError
from engine.core.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

# How long rank 0 waits to learn which of its machine's ranks died when a collective broke, and how long
# stopped ranks get to exit before they are ended.
START_S = 5.0
STOP_S = 10.0
# The ForwardBatch fields sent as integers, in order (extra_slots and the logit rows when present).
_INT_FIELDS = ("input_ids", "positions", "out_slots", "rows")


class Leader:
    """Rank 0's side. `ranks`: this machine's other ranks (launch.LocalRanks), which says when one died."""

    def __init__(self, group: Group, ranks):
        self.group, self.ranks = group, ranks
        self.failed: Optional[str] = None
        self.slot_map: Optional[torch.Tensor] = None

    def attach(self, worker) -> None:
        """Lead the worker's model forwards from now on: the target's and a model drafter's."""
        from engine.speculative.model_drafter import ModelDrafter

        self.slot_map = _slot_map(worker)
        worker.target.leader = self
        if isinstance(worker.drafter, ModelDrafter):
            worker.drafter.leader = self

    def target(self, run: Callable, batch: ForwardBatch, logit_rows: Optional[torch.Tensor], all_logits: bool,
               decode: bool):
        """Announce a target forward, then run it here (run(batch, logit_rows, all_logits, decode))."""
        meta = {"all_logits": all_logits, "decode": decode}
        return self._run(lambda: self._send("target", meta, batch, None, logit_rows, self.slot_map),
                         lambda: run(batch, logit_rows, all_logits, decode))

    def feed(self, run: Callable, batch: ForwardBatch, features: Optional[torch.Tensor]):
        """Announce a draft forward, then run it here."""
        return self._run(lambda: self._send("feed", {}, batch, features, None), lambda: run(batch, features))

    def scores(self, run: Callable, hidden: torch.Tensor):
        """Announce the draft's logits, then compute them here."""
        return self._run(lambda: self._send("scores", {}, None, hidden, None), lambda: run(hidden))

    def set_speculative(self, changes: dict) -> None:
        self._run(lambda: self._send("set_speculative", changes, None, None, None), lambda: None)

    def started(self) -> None:
        """Every rank has built its engine (a rank that failed ends this at once: launch.py)."""
        dist.barrier()

    def start_failed(self, exc: BaseException) -> BaseException:
        """What to raise when this rank's start-up raised `exc`: this rank's own refusal (the others meet
        the same one), else which rank failed."""
        if isinstance(exc, SpecError) and not isinstance(exc, DistributedError):
            self.ranks.stop(timeout=0)
            group.destroy()
            return exc
        dead = self.ranks.wait_for_death(START_S)
        self.ranks.stop(timeout=0)
        group.destroy()
        return DistributedError(f"tensor parallelism could not start: {dead or ' '.join(str(exc).split())[:300]}")

    def stop(self) -> None:
        """Let the other ranks exit; they are ended when they do not."""
        self.ranks.stopping()
        graceful = self.failed is None and not self.ranks.dead
        if graceful:
            try:
                self._run(lambda: self._send("stop", {}, None, None, None), lambda: None)
            except DistributedError:
                graceful = False
        self.ranks.stop(timeout=STOP_S if graceful else 0)
        group.destroy()         # this process may lead another group later

    def _run(self, send: Callable[[], None], compute: Callable[[], Any]):
        """Announce, then compute. A failure while the ranks are in a collective leaves them out of step:
        the group is finished, and says which rank failed when it knows."""
        if self.failed is None and self.ranks.dead:
            self.failed = f"tensor parallelism stopped: {self.ranks.dead}"
        if self.failed is not None:
            raise DistributedError(self.failed)
        try:
            send()
            return compute()
        except Exception as exc:
            if isinstance(exc, SpecError) and not isinstance(exc, DistributedError):
                raise                   # refused before any collective ran (set_speculative's checks)
            cause = self.ranks.wait_for_death(START_S) or f"a collective failed ({' '.join(str(exc).split())[:200]})"
            self.failed = f"tensor parallelism stopped: {cause}"
            raise DistributedError(self.failed) from exc

    def _send(self, op: str, meta: dict, batch: Optional[ForwardBatch], tensor: Optional[torch.Tensor],
              logit_rows: Optional[torch.Tensor], slot_map: Optional[torch.Tensor] = None) -> None:
        header: dict[str, Any] = {"op": op, "meta": meta}
        ints = masks = None
        if batch is not None:
            prefix = max(batch.prefix_lens)
            table = batch.table[batch.rows, :prefix]
            parts = [getattr(batch, f) for f in _INT_FIELDS] + [table.flatten()]
            parts += [t for t in (batch.extra_slots, logit_rows) if t is not None]
            if slot_map is not None:        # the window slot of every slot the forward writes or reads
                slots = [batch.out_slots, parts[4]] + ([] if batch.extra_slots is None else [batch.extra_slots])
                parts.append(slot_map[torch.cat([t.long() for t in slots])])
            ints = torch.cat([p.long() for p in parts])
            masks = batch.masks
            header["batch"] = {"sizes": [len(p) for p in parts], "prefix": prefix, "prefix_lens": batch.prefix_lens,
                               "extend_lens": batch.extend_lens, "extra_lens": batch.extra_lens,
                               "extra": batch.extra_slots is not None, "logit_rows": logit_rows is not None,
                               "window": slot_map is not None, "masks": None if masks is None else tuple(masks.shape),
                               "capture_hidden": batch.capture_hidden}
        if tensor is not None:
            header["tensor"] = (tuple(tensor.shape), tensor.dtype)
        dist.broadcast_object_list([header], src=0, group=self.group.messages)
        for t in (ints, masks, tensor):
            if t is not None:
                dist.broadcast(t.contiguous(), src=0)


class Follower:
    """Every other rank's side: receive rank 0's messages and run the same forwards, until "stop"."""

    def __init__(self, group: Group):
        self.group = group
        self.worker = None

    def attach(self, worker) -> None:
        self.worker = worker
        self.slot_map = _slot_map(worker)

    def started(self) -> None:
        dist.barrier()

    def set_speculative(self, changes: dict) -> None:
        """Nothing to announce: rank 0 did, and this rank runs the same call (`run`)."""

    def start_failed(self, exc: BaseException) -> BaseException:
        return exc

    def run(self, engine) -> None:
        with torch.inference_mode():
            while True:
                header = [None]
                dist.broadcast_object_list(header, src=0, group=self.group.messages)
                op, meta = header[0]["op"], header[0]["meta"]
                if op == "stop":
                    return
                if op == "set_speculative":
                    self._set_speculative(engine, meta)
                    continue
                batch, logit_rows = self._receive_batch(header[0].get("batch"))
                tensor = self._receive_tensor(header[0].get("tensor"))
                if op == "target":
                    self.worker.target.forward(batch, logit_rows, **meta)
                elif op == "feed":
                    self.worker.drafter.feed(batch, tensor)
                else:
                    self.worker.drafter.scores(tensor)

    @staticmethod
    def _set_speculative(engine, changes: dict) -> None:
        # Rank 0 runs the same call on the same arguments: it refuses what this rank refuses.
        try:
            engine.set_speculative(**changes)
        except SpecError as exc:
            log.debug("set_speculative refused here as on rank 0: %s", exc)

    def _receive_batch(self, spec: Optional[dict]) -> tuple[Optional[ForwardBatch], Optional[torch.Tensor]]:
        if spec is None:
            return None, None
        table = self.worker.table
        ints = torch.empty(sum(spec["sizes"]), dtype=torch.long, device=table.device)
        dist.broadcast(ints, src=0)
        parts = list(ints.split(spec["sizes"]))
        input_ids, positions, out_slots, rows, prefix_slots = parts[:5]
        rest = parts[5:]
        extra = rest.pop(0) if spec["extra"] else None
        logit_rows = rest.pop(0) if spec["logit_rows"] else None
        table[rows, :spec["prefix"]] = prefix_slots.view(len(rows), spec["prefix"])
        if spec["window"]:
            self.slot_map[torch.cat([out_slots, prefix_slots] + ([] if extra is None else [extra]))] = rest.pop(0)
        masks = None
        if spec["masks"] is not None:
            masks = torch.empty(spec["masks"], dtype=torch.bool, device=table.device)
            dist.broadcast(masks, src=0)
        return ForwardBatch(input_ids, positions, out_slots, table, rows, spec["prefix_lens"], spec["extend_lens"],
                            extra, spec["extra_lens"], masks, spec["capture_hidden"]), logit_rows

    def _receive_tensor(self, spec: Optional[tuple]) -> Optional[torch.Tensor]:
        if spec is None:
            return None
        shape, dtype = spec
        tensor = torch.empty(shape, dtype=dtype, device=self.worker.table.device)
        dist.broadcast(tensor, src=0)
        return tensor


def _slot_map(worker) -> Optional[torch.Tensor]:
    """The target's window pool's slot map (full slot -> window slot), None without a window pool."""
    window = worker.target.kv_pool.window
    return None if window is None else window.slot_map
