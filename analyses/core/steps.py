"""Finished steps kept on disk, so that a long run stopped part-way finishes later without redoing
them (``interp task --resume``), as a study keeps its rows (architecture §4.5, ``analyses.studies.runner``).

``Steps(directory, inputs, resume)`` is the store: ``inputs`` is the run's fingerprint, a JSON
record of everything its results depend on (the model's ``interp.provenance``, with its weights
hash, and how it runs; the task's contents and tokens; every option that may change a number),
written to ``directory/steps.json`` when the run starts. ``steps(name, compute)`` returns the
step's value: read from ``directory/steps/<name>.json`` where that file holds the same fingerprint,
else computed by ``compute()`` and written there at once (to a temporary name, then renamed: a file
on disk is always a finished step). So a rerun with the same inputs computes only the steps that
were not finished; a rerun with other inputs is refused in one line naming the inputs that changed,
their old and new values; a directory that already holds steps is refused without ``resume``, as
a study's results are (pass ``--resume`` to finish or reuse them, or choose another ``--out``).

Values are stored as JSON, exactly: floats by their shortest round-trip text, a ``pandas.DataFrame``
with its columns' dtypes and its index, so a value read back equals the one computed (the page made
from it is the same bytes). A value may be None, a bool, int, float, str, a list or a dict of
those, or a DataFrame.

``directory_lock`` (a run's exclusive hold on its directory) is shared with the study runner.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import pandas as pd

from interp.errors import UserError
from interp.files import remove_stale_temporaries
from interp.files import write_atomic

RECORD, FOLDER, LOCK = "steps.json", "steps", ".lock"


@contextmanager
def directory_lock(out: Path, what: str = "study run") -> Iterator[None]:
    """Hold an exclusive lock on the directory ``out`` (``flock`` of ``out/.lock``) for the block, or
    refuse if another run (``what``) holds it. The kernel drops the lock when the file is closed,
    also when the process is killed; the temporaries a killed run's atomic writes left in ``out`` and below it go
    once the lock is held (``interp.files.remove_stale_temporaries``)."""
    with open(out / LOCK, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"{out} is in use by another {what} (it holds {out / LOCK}); "
                            "wait for it to end, or choose another --out") from None
        remove_stale_temporaries(out)
        yield


def record_text(record: dict) -> str:
    """A JSON record as the files hold it: sorted keys, indented, one final newline."""
    return json.dumps(record, indent=2, sort_keys=True) + "\n"


def _flat(record: dict, prefix: str = "") -> dict[str, object]:
    """``{"model": {"impl": "scratch"}, "cells": [{"cell": "a"}]}`` -> ``{"model.impl": "scratch",
    "cells.0.cell": "a"}``."""
    flat = {}
    for key, value in record.items():
        if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
            value = dict(enumerate(value))
        if isinstance(value, dict) and value:
            flat |= _flat(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def changes(before: dict, now: dict, most: int = 4) -> str:
    """The inputs whose values differ, in words, in sorted order of the flattened keys: the first
    ``most`` of them, then how many more."""
    old, new = _flat(before), _flat(now)
    changed = [f"{key} was {old.get(key, '(none)')!r}, now {new.get(key, '(none)')!r}"
               for key in sorted(old.keys() | new.keys()) if old.get(key, "(none)") != new.get(key, "(none)")]
    more = f"; and {len(changed) - most} more" if len(changed) > most else ""
    return "; ".join(changed[:most]) + more if changed else "nothing"


def encode_value(value) -> object:
    """A step's value as JSON-able data (DataFrames tagged with their dtypes and index)."""
    if isinstance(value, pd.DataFrame):
        if not all(isinstance(c, str) for c in value.columns) or not value.columns.is_unique:
            raise TypeError(f"a stored DataFrame needs unique string column names, not {list(value.columns)}")
        ranged = value.index.equals(pd.RangeIndex(len(value)))
        return {"__frame__": {"columns": list(value.columns), "dtypes": [str(d) for d in value.dtypes],
                              "index": None if ranged else value.index.tolist(),
                              "data": [[None if pd.isna(v) else v for v in value[c].tolist()] for c in value.columns]}}
    if isinstance(value, dict):
        if "__frame__" in value:
            raise UserError("a step's dict may not have the key '__frame__' (it marks a stored DataFrame)")
        return {str(k): encode_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a step's value must be JSON data or a DataFrame, not {type(value).__name__}")


def decode_value(data) -> object:
    """The inverse of ``encode_value`` (a tuple comes back a list)."""
    if isinstance(data, dict) and "__frame__" in data:
        frame = data["__frame__"]
        columns = {name: pd.Series(values, dtype=object) for name, values in zip(frame["columns"], frame["data"])}
        table = pd.DataFrame(columns, columns=frame["columns"])
        table = table.astype(dict(zip(frame["columns"], frame["dtypes"])))
        if frame["index"] is not None:
            table.index = frame["index"]
        return table
    if isinstance(data, dict):
        return {k: decode_value(v) for k, v in data.items()}
    if isinstance(data, list):
        return [decode_value(v) for v in data]
    return data


def check_steps_dir(directory: Path, resume: bool) -> None:
    """Refuse a directory that holds a run's steps unless ``resume`` (cheap: before any model loads)."""
    recorded = Path(directory) / RECORD
    if recorded.exists() and not resume:
        raise UserError(f"{recorded} exists: {directory} holds a run's steps; pass --resume to finish or reuse them, "
                        "or choose another --out")


class Steps:
    """The finished steps of one run in ``directory`` (see the module docstring), for inputs
    ``inputs`` (a JSON record). Creating it checks the directory and records the inputs; calling it,
    ``steps(name, compute)``, gives a step's value. ``reused`` / ``computed``: the steps' names so far."""

    def __init__(self, directory: str | Path, inputs: dict, resume: bool = False):
        self.directory, self.inputs = Path(directory), inputs
        self.fingerprint = "sha256:" + hashlib.sha256(record_text(inputs).encode()).hexdigest()
        recorded = self.directory / RECORD
        check_steps_dir(self.directory, resume)
        if recorded.exists():
            try:
                before = json.loads(recorded.read_text())
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise UserError(f"{recorded} is not the JSON record this run writes; use a new --out") from None
            if before != inputs:
                raise UserError(f"--resume: {self.directory} holds the steps of other inputs ({changes(before, inputs)}; "
                                f"see {recorded}); resume with the inputs it began with, or use a new --out")
        self.directory.mkdir(parents=True, exist_ok=True)
        write_atomic(recorded, record_text(inputs))
        self.reused: list[str] = []
        self.computed: list[str] = []

    def path(self, name: str) -> Path:
        return self.directory / FOLDER / f"{name}.json"

    def __call__(self, name: str, compute: Callable[[], object]) -> object:
        """Step ``name``'s value: the finished one on disk for these inputs, else ``compute()``,
        written to disk before it is returned."""
        path = self.path(name)
        if path.is_file():
            try:
                stored = json.loads(path.read_text())
            except (UnicodeDecodeError, json.JSONDecodeError):
                stored = None  # written only by rename, so never torn: not ours, computed again
            if isinstance(stored, dict) and stored.get("inputs") == self.fingerprint:
                self.reused.append(name)
                return decode_value(stored["value"])
        value = compute()
        write_atomic(path, json.dumps({"inputs": self.fingerprint, "step": name, "value": encode_value(value)}) + "\n")
        self.computed.append(name)
        return decode_value(encode_value(value))  # as a rerun will read it, so both give the same page
