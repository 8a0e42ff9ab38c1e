"""Study rows computed by Ray actors (``interp study run SPEC --ray [ADDRESS]``; DESIGN 4.5).

Imported only when a study runs on Ray (Ray is the optional extra ``interp[ray]``). Each actor is a
``StudyCells`` (``analyses.studies.runner``): it loads a cell's model once and keeps it for the cell's row
blocks, on one GPU where the cluster has GPUs, else on one CPU. The driver (``RayCells``) asks every
actor to prepare a cell, checks that they agree on it (same weights hash, same rows, same baseline:
a node with other files or other numerics would otherwise mix its rows into the file), then hands
out blocks of rows, at most two in flight per actor, and yields the rows in row order as blocks
complete, so the driver's file is written exactly as a local run writes it.

Every row is still computed by its own forward, so the bytes do not depend on the block size, the
number of actors or the order they finish in. A block is as many rows as one forward under the
memory budget would hold (``CellPlan.block_rows``), and small enough that each actor gets several
(``SHARES``): a slow actor, or a block retried, then holds up little.
An actor whose process dies is restarted by Ray and its unfinished blocks are run again
(``max_restarts``, ``max_task_retries``): a block's rows reach the driver once, from whichever
attempt completes. A ``UserError`` raised on an actor reaches the caller as itself, one line.
"""

from __future__ import annotations

import logging
import math
import socket
from collections import deque
from typing import Iterator

import ray
from ray.exceptions import RayTaskError

from analyses.studies.cells import CellPlan, StudyCells
from analyses.studies.spec import Cell
from interp.errors import UserError

RESTARTS = 3  # per actor, and retries per block: a process killed mid-block costs one retry
IN_FLIGHT = 2  # blocks queued per actor, so it never waits for the driver between blocks
SHARES = 4  # blocks per actor at least, so a slow actor or a retried block delays little
CONNECT_TIMEOUT_S = 5.0


@ray.remote(max_restarts=RESTARTS, max_task_retries=RESTARTS)
class StudyWorker:
    """One Ray actor: a ``StudyCells`` on the device Ray gave it."""

    def __init__(self, cells: tuple[Cell, ...]):
        self.cells = StudyCells(cells, device="cuda" if ray.get_gpu_ids() else None)

    def plan(self, index: int) -> CellPlan:
        return self.cells.plan(index)

    def rows(self, index: int, start: int, stop: int) -> list[float]:
        """The metric of rows ``start:stop`` of cell ``index``, in order."""
        return [value for _, value in self.cells.rows(index, start, stop)]


def check_reachable(address: str) -> None:
    """Refuse at once, in one line, an address where nothing answers (``ray.init`` would retry for
    minutes). ``HOST:PORT`` or ``ray://HOST:PORT``; ``auto`` is left to Ray."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--ray {address!r}: expected HOST:PORT (the head's GCS port, 6379 by default), "
                        "ray://HOST:PORT, or auto")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as error:
        raise UserError(f"--ray {address!r}: no Ray cluster answers there ({error.strerror or error}); "
                        "start one with `ray start --head`, or pass --ray alone for a local one") from None


def connect(address: str | None) -> bool:
    """Join the Ray cluster at ``address`` (None: a new local instance; "auto": the one running on
    this machine), unless this process is already connected to it; returns whether it connected
    here (and so should disconnect). An address is probed first, also when already connected."""
    named = address not in (None, "auto")
    if named:
        check_reachable(address)
    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if named and address != current:
            raise UserError(f"--ray {address!r}: this process is already connected to the Ray cluster at "
                            f"{current!r}, and one process joins one cluster")
        return False
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    except ConnectionError as error:
        raise UserError(f"--ray {address!r}: {str(error).splitlines()[0]}") from None
    return True


def worker_count(workers: int | None) -> tuple[int, dict]:
    """(how many actors, each one's resources): one per GPU of the cluster, else one per CPU;
    ``workers`` caps it."""
    if workers is not None and workers < 1:
        raise UserError(f"--workers {workers}: must be >= 1")
    resources = ray.cluster_resources()
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 1))
    count, each = (gpus, {"num_gpus": 1}) if gpus else (max(1, cpus), {"num_cpus": 1})
    return (count if workers is None else min(workers, count)), each


def result(ref):
    """``ray.get`` of one task, with a ``UserError`` raised on an actor re-raised as itself."""
    try:
        return ray.get(ref)
    except RayTaskError as error:
        if isinstance(error.cause, UserError):
            raise error.cause from None
        raise


class RayCells:
    """The Ray executor, a context manager: actors started on entry and killed on exit, the Ray
    connection closed if it was opened here. ``plan`` and ``rows`` as ``StudyCells``'."""

    def __init__(self, cells: tuple[Cell, ...], address: str | None = None, workers: int | None = None):
        self.cells, self.address, self.workers = cells, address, workers
        self.actors: list = []
        self.connected = False
        self.plans: dict[int, CellPlan] = {}

    def __enter__(self) -> "RayCells":
        self.connected = connect(self.address)
        count, resources = worker_count(self.workers)
        self.actors = [StudyWorker.options(**resources).remote(self.cells) for _ in range(count)]
        return self

    def __exit__(self, *exc) -> None:
        for actor in self.actors:
            ray.kill(actor)
        if self.connected:
            ray.shutdown()

    def plan(self, index: int) -> CellPlan:
        """Every actor prepares cell ``index`` (loading its model); they must agree."""
        plans = [result(ref) for ref in [actor.plan.remote(index) for actor in self.actors]]
        for plan in plans[1:]:
            for field in CellPlan._fields:
                if getattr(plan, field) != getattr(plans[0], field):
                    cell = self.cells[index].name or self.cells[index].spec.model
                    raise UserError(f"Ray workers disagree on {field} of {cell!r} ({getattr(plans[0], field)!r} vs "
                                    f"{getattr(plan, field)!r}): are the model files and hardware the same on every node?")
        self.plans[index] = plans[0]
        return plans[0]

    def rows(self, index: int, start: int, stop: int) -> Iterator[tuple[int, float]]:
        """(row, metric) of rows ``start:stop`` of cell ``index`` (planned first) in row order, as
        blocks complete."""
        size = max(1, min(self.plans[index].block_rows, math.ceil((stop - start) / (SHARES * len(self.actors)))))
        todo = deque((first, min(first + size, stop)) for first in range(start, stop, size))
        pending, done, next_row = {}, {}, start

        def submit(actor) -> None:
            if todo:
                block = todo.popleft()
                pending[actor.rows.remote(index, *block)] = (actor, block[0])

        for actor in self.actors * IN_FLIGHT:
            submit(actor)
        while pending:
            [ready], _ = ray.wait(list(pending), num_returns=1)
            actor, first = pending.pop(ready)
            done[first] = result(ready)
            submit(actor)
            while next_row in done:
                for value in done.pop(next_row):
                    yield next_row, value
                    next_row += 1
