"""Study rows computed by Ray actors (``interp study run SPEC --ray [ADDRESS]``; architecture §4.5).

Imported only when a study runs on Ray (Ray is the optional extra ``interp[ray]``). Each actor is a
``StudyCells`` (``analyses.studies.runner``): it loads a cell's model once and keeps it for the cell's row
blocks. How many actors, and what each asks of Ray, is ``actor_plan`` (pure: resources in, plan out): one
per GPU where the cluster has GPUs; else, on each live node, as many as its CPUs and its memory hold, each
actor asking Ray for the memory it needs (``memory=``: the largest model of the study in its dtype, sized
from its files without loading it (``loaded_bytes``), + the study's ``memory_mb`` + ``RUNTIME_MB``), so
Ray's scheduler never puts more copies of the model on a node than fit (an actor waits while other work
holds the room, as a task does). The driver (``RayCells``) asks every
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
from importlib import resources
from pathlib import Path
from typing import Iterator, Mapping, NamedTuple

import ray
from huggingface_hub import try_to_load_from_cache
from ray.exceptions import RayTaskError
from safetensors import SafetensorError, safe_open

from analyses.core.budget import DEFAULT_MEMORY_MB
from analyses.studies.cells import CellPlan, StudyCells
from analyses.studies.spec import Cell
from interp.errors import UserError
from interp.loading import EMBEDDED, resolve_dtype

RESTARTS = 3  # per actor, and retries per block: a process killed mid-block costs one retry
IN_FLIGHT = 2  # blocks queued per actor, so it never waits for the driver between blocks
SHARES = 4  # blocks per actor at least, so a slow actor or a retried block delays little
CONNECT_TIMEOUT_S = 5.0
# a worker process's own memory beyond the model and the analysis: Python, torch, transformers and Ray's
# worker (a study actor on the toy model, 16 x 32 tokens, peaked at 0.59 GB resident), with room to spare
RUNTIME_MB = 1024
MB = 2**20


@ray.remote(max_restarts=RESTARTS, max_task_retries=RESTARTS)
class StudyWorker:
    """One Ray actor: a ``StudyCells`` on the device Ray gave it."""

    def __init__(self, cells: tuple[Cell, ...], memory_mb: float):
        # the budget crosses to the actor's process as an argument: the driver's execution does not
        self.cells = StudyCells(cells, device="cuda" if ray.get_gpu_ids() else None, memory_mb=memory_mb)

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


class ActorPlan(NamedTuple):
    """How many study actors to start, and what each one asks of Ray (``.options(**options)``):
    ``{"num_gpus": 1}``, or ``{"num_cpus": 1, "memory": bytes}``."""

    count: int
    options: dict


def actor_plan(nodes: list[Mapping[str, float]], need_bytes: int, workers: int | None = None,
               what: str = "a study worker") -> ActorPlan:
    """The actors for a cluster whose live nodes have the resources ``nodes`` (each as Ray reports it
    in ``ray.nodes()``: ``CPU``, ``GPU``, ``memory`` in bytes): where any node has GPUs, one actor per GPU,
    each on its GPU; else, on each node, as many as both its CPUs and its memory hold at
    ``need_bytes`` each (what one actor holds: ``what``), each asking Ray for one CPU and
    ``need_bytes`` of memory. ``workers`` caps the count. A cluster where no node holds one actor is
    refused in one line naming the sizes."""
    if workers is not None and workers < 1:
        raise UserError(f"--workers {workers}: must be >= 1")
    gpus = sum(int(node.get("GPU", 0)) for node in nodes)
    if gpus:
        count, options = gpus, {"num_gpus": 1}
    else:
        count = sum(min(int(node.get("CPU", 0)), int(node.get("memory", 0) // need_bytes)) for node in nodes)
        options = {"num_cpus": 1, "memory": int(need_bytes)}
        if count < 1:
            most = max((node.get("memory", 0) for node in nodes), default=0)
            cpus = max((int(node.get("CPU", 0)) for node in nodes), default=0)
            raise UserError(f"Ray: no node has room for {what} ({need_bytes / 2**30:.2f} GiB); the most memory a node "
                            f"gives Ray is {most / 2**30:.2f} GiB (CPUs on a node: at most {cpus})")
    return ActorPlan(count if workers is None else min(workers, count), options)


def loaded_bytes(spec: str, dtype: str) -> int:
    """About the bytes model ``spec`` takes once loaded in ``dtype``, read from its files without
    loading it: every floating tensor of its safetensors files at ``dtype``'s element size, other
    tensors at their own; where it has no safetensors files, the size of its weight files on disk.
    ``spec`` as ``load_model`` takes it: an embedded model, a directory, or a hub id in the local
    Hugging Face cache (one not downloaded yet cannot be sized, and is refused in one line)."""
    if spec in EMBEDDED:
        folder = Path(str(resources.files("interp") / EMBEDDED[spec][0]))
    elif Path(spec).expanduser().is_dir():
        folder = Path(spec).expanduser()
    else:
        try:
            cached = try_to_load_from_cache(spec, "config.json")
        except ValueError:  # not a hub id either (a directory that is not there): nothing to size
            cached = None
        folder = Path(cached).parent if isinstance(cached, str) else None
    files = sorted(folder.glob("*.safetensors")) if folder is not None else []
    if not files:
        others = [p for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth")] if folder is not None else []
        if not others:
            raise UserError(f"Ray: cannot size model {spec!r} for the study workers: no weight files of it on this "
                            "machine (the driver's: a directory must be here too, a hub id in the local Hugging "
                            "Face cache: load it here once)")
        return sum(p.stat().st_size for p in others)
    element = resolve_dtype(dtype).itemsize
    total = 0
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as file:
                for name in file.keys():
                    part = file.get_slice(name)
                    stored = part.get_dtype()
                    size = element if stored.startswith(("F", "BF")) else SAFETENSORS_SIZES.get(stored, 8)
                    total += math.prod(part.get_shape()) * size
        except SafetensorError as error:
            raise UserError(f"{path} is not a readable safetensors file: {error}") from None
    return total


# element sizes of the safetensors dtypes that are not floating point (which take the study's dtype);
# any other is counted at 8 bytes, the most a tensor element takes
SAFETENSORS_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8}


def worker_need(cells: tuple[Cell, ...], memory_mb: float) -> tuple[int, str]:
    """(bytes one actor holds at most, what that is): the largest model of the cells in its dtype
    (one model at a time: ``StudyCells`` frees a model before loading the next), + ``memory_mb`` (the
    analysis's budget) + ``RUNTIME_MB``."""
    sizes = {(cell.spec.model, cell.spec.dtype): 0 for cell in cells}
    for model, dtype in sizes:
        sizes[model, dtype] = loaded_bytes(model, dtype)
    (model, dtype), weights = max(sizes.items(), key=lambda item: item[1])
    need = weights + int((memory_mb + RUNTIME_MB) * MB)
    return need, (f"a study worker: model {model!r} in {dtype} ({weights / 2**30:.2f} GiB) + memory_mb {memory_mb:g} "
                  f"+ {RUNTIME_MB} MB for the runtime")


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

    def __init__(self, cells: tuple[Cell, ...], address: str | None = None, workers: int | None = None,
                 memory_mb: float = DEFAULT_MEMORY_MB):
        self.cells, self.address, self.workers, self.memory_mb = cells, address, workers, memory_mb
        self.actors: list = []
        self.connected = False
        self.plans: dict[int, CellPlan] = {}

    def __enter__(self) -> "RayCells":
        need, what = worker_need(self.cells, self.memory_mb)  # before connecting: a model not found is said at once
        self.connected = connect(self.address)
        try:
            nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
            plan = actor_plan(nodes, need, self.workers, what)
        except UserError:
            self.__exit__()
            raise
        self.actors = [StudyWorker.options(**plan.options).remote(self.cells, self.memory_mb)
                       for _ in range(plan.count)]
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
