"""Work held at a gate, for calls that run in another process (the server's body parser, for one):
the call reports its arrival with its process id, then waits until the test opens the gate. It imports
nothing of the engine, so a child process loads it at once."""

from __future__ import annotations

import os


def held(gate, arrived, work, *args):
    """work(*args) once `gate` (a multiprocessing Manager's Event) is set; first puts this process's id
    on `arrived` (a Manager's Queue)."""
    arrived.put(os.getpid())
    gate.wait()
    return work(*args)
