"""Scripted ablation studies (architecture §4.5): ``interp study run SPEC.toml --out DIR [--resume] [--ray [ADDRESS]]``.

Each target of the spec is one row of ``DIR/results.csv``, appended (flushed, fsynced) as soon as
it is computed; every row is computed by its own forward, so its value does not depend on which
rows were computed before, nor on which process computed it (a resumed run, or one sharded over
Ray, gives the very same bytes). A killed run loses at most the rows in flight (a torn last line is
dropped on resume); ``--resume`` checks that the rows on disk are the spec's rows in order and
computes only the missing ones. A run holds an exclusive lock on DIR (``flock`` of ``DIR/.lock``,
dropped when it ends or is killed), so a second run on DIR is refused. Once a model is loaded and
the spec checked against it, ``DIR/spec.json`` records the spec (with ``[run].memory_mb``) and
``DIR/provenance.json`` the model (``interp.provenance``: family, impl, weights hash) and how it ran
(dtype, precision, device, start token); resuming with a different spec, another model or the
model run otherwise is refused. ``DIR/results.png`` plots the table.

Columns: ``row, target, layer, head, n_heads, metric, baseline, effect`` (layer / head empty
where the target is not one layer / one head; floats written in full precision). A grid (a list in
place of a spec value, ``analyses.studies.spec``) adds a first column ``cell``: the cells' rows follow
each other in the grid's order, ``row`` counting from 0 in each cell, so a row is identified by
(cell, row, target); ``provenance.json`` then holds ``{"cells": {cell: model record}}``, one model
record per cell, added as each cell starts. On resume, a cell followed by rows of a later one is
complete (cells are written in order), so only the last cell with rows on disk, and those after it,
load their models.

Executors: ``local`` (this process, one model at a time) or ``ray`` (``analyses.studies.on_ray``, imported
only then: Ray is an optional extra). Both go through the same driver loop here, which alone writes
the file.
"""

from __future__ import annotations

import csv
import io
import json
import os
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from analyses.interventions.ablation import MLP, target_location
from analyses.report.intervention_figures import ablation_figure, heatmap, save_figure
from analyses.core.execution import executing
from analyses.core.progress import progress_bar
from analyses.core.steps import changes, directory_lock, record_text
from analyses.studies.spec import EXECUTORS, Study, load_spec
from analyses.core.plots import new_figure
from interp.files import write_atomic
from interp.errors import UserError
from analyses.studies.cells import CellPlan, StudyCells

COLUMNS = ["row", "target", "layer", "head", "n_heads", "metric", "baseline", "effect"]
RESULTS, SPEC_RECORD, MODEL_RECORD = "results.csv", "spec.json", "provenance.json"


def format_row(index: int, name: str, components: list, value: float, baseline: float) -> list[str]:
    """A results row; ``layer`` and ``head`` as ``target_location`` gives them (empty where none),
    ``n_heads`` counts the heads among ``components`` (an MLP target has 0)."""
    layer, head = target_location(components) if components else (None, None)
    n_heads = sum(not isinstance(c, MLP) for c in components)
    return [str(index), name, "" if layer is None else str(layer), "" if head is None else str(head), str(n_heads),
            repr(value), repr(baseline), repr(value - baseline)]


def _csv_line(fields: list[str]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerow(fields)
    return buffer.getvalue()


def columns(study: Study) -> list[str]:
    return (["cell"] if study.is_grid else []) + COLUMNS


@contextmanager
def open_executor(study: Study, executor: str | None, address: str | None, workers: int | None):
    """The executor that computes the rows: ``StudyCells`` here, or Ray actors (``executor``,
    ``address`` and ``workers`` override the spec's ``[run]``)."""
    executor = executor or study.executor
    if executor not in EXECUTORS:
        raise UserError(f"executor {executor!r}; allowed: {', '.join(EXECUTORS)}")
    if executor == "local":
        yield StudyCells(study.cells, study.device, study.memory_mb)
        return
    try:
        from analyses.studies.on_ray import RayCells
    except ModuleNotFoundError as error:
        if error.name != "ray" and not str(error.name).startswith("ray."):
            raise
        raise UserError("--ray needs Ray, an optional extra that is not installed: pip install 'interp[ray]'") from None
    with RayCells(study.cells, address or study.address, workers or study.workers, study.memory_mb) as cells:
        yield cells


class RowsOnDisk(NamedTuple):
    """The complete rows of a results file: per cell name (None outside a grid), its rows' target
    names in order; ``complete``: the bytes up to the last complete line."""

    path: Path
    names: dict[str | None, list[str]]
    complete: int

    def resume_cell(self, study: Study) -> int:
        """The first cell to prepare: the last one with rows on disk (the earlier ones are complete)."""
        with_rows = [c for c, cell in enumerate(study.cells) if cell.name in self.names]
        return with_rows[-1] if with_rows else 0

    def check_cell(self, cell: str | None, expected: list[str]) -> int:
        """How many of ``cell``'s rows are on disk, checked to be the first of ``expected``."""
        found = self.names.get(cell, [])
        for i, name in enumerate(found):
            if i >= len(expected) or name != expected[i]:
                where = "" if cell is None else f" of cell {cell!r}"
                spec_gives = expected[i] if i < len(expected) else "nothing"
                raise UserError(f"{self.path} row {i}{where} is {[str(i), name]} but the spec gives "
                                f"[{i!r}, {spec_gives!r}]; use a new --out")
        return len(found)


def read_rows(path: Path, study: Study) -> RowsOnDisk:
    """The rows already in ``path`` (none if it does not exist), checked to be laid out as this
    study writes them: our header, cells in the grid's order, rows numbered from 0 in each."""
    data = path.read_bytes() if path.exists() else b""
    header = _csv_line(columns(study)).encode()
    if not (data.startswith(header) or header.startswith(data)):
        raise UserError(f"{path} does not start with the results header {','.join(columns(study))!r}; "
                        "not a study of ours, or of this spec")
    complete = data[: data.rfind(b"\n") + 1]
    order = [cell.name for cell in study.cells]
    names: dict[str | None, list[str]] = {}
    position = 0
    for line, fields in enumerate(csv.reader(complete.decode().splitlines()[1:]), start=2):
        cell, row, target = fields[:3] if study.is_grid else [None, *fields[:2]]
        if cell not in order[position:]:
            raise UserError(f"{path} line {line} is of cell {cell!r}, which the spec does not list "
                            f"at or after {order[position]!r}; use a new --out")
        position = order.index(cell, position)
        listed = names.setdefault(cell, [])
        if row != str(len(listed)):
            raise UserError(f"{path} line {line} is row {row!r} where row {len(listed)} was due; use a new --out")
        listed.append(target)
    return RowsOnDisk(path, names, len(complete))


@contextmanager
def open_results(on_disk: RowsOnDisk, header: list[str]) -> Iterator[io.TextIOBase]:
    """``results.csv`` opened for appending: a torn last line cut off, the header written if the
    file is new."""
    with open(on_disk.path, "a", newline="") as handle:
        handle.truncate(on_disk.complete)
        if on_disk.complete == 0:
            handle.write(_csv_line(header))
        yield handle


def check_out_dir(out: Path, study: Study, resume: bool) -> None:
    """Before loading any model: refuse to overwrite results, or to resume results of another spec."""
    results, recorded = out / RESULTS, out / SPEC_RECORD
    if results.exists() and not resume:
        raise UserError(f"{results} already exists; pass --resume to finish it, or choose another --out")
    if resume and recorded.exists():
        try:
            before = json.loads(recorded.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise UserError(f"{recorded} is not the JSON record this study writes; use a new --out") from None
        now = json.loads(record_text(study.record()))  # as written: a tuple is a list
        if before != now:
            raise UserError(f"--resume: {out} holds a study of a different spec or prompt file "
                            f"({changes(before, now)}; see {recorded}); use a new --out")


def _model_records(out: Path) -> dict | None:
    path = out / MODEL_RECORD
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"{path} is not the JSON record this study writes; use a new --out") from None


def check_model(out: Path, cell: str | None, model_record: dict[str, str]) -> None:
    """Refuse to add rows to rows of another model, or of the model run otherwise: ``model_record``
    (``CellPlan.record`` of the model loaded now: family, impl, weights hash, dtype, precision,
    device, start token) must be the one recorded for the cell's rows."""
    recorded = _model_records(out)
    if cell is not None and recorded is not None:
        recorded = recorded.get("cells", {}).get(cell)
    if recorded is None:
        whose = "the model its rows came from" if cell is None else f"the model of cell {cell!r}"
        raise UserError(f"--resume: {out} has no {MODEL_RECORD} recording {whose}; use a new --out")
    for key, value in model_record.items():
        if recorded.get(key) != value:
            raise UserError(f"--resume: the rows in {out} came from {key} {recorded.get(key)!r}, "
                            f"but the model loaded now has {value!r}; use a new --out")


def write_records(out: Path, study: Study, cell: str | None, model_record: dict[str, str]) -> None:
    """``spec.json``, and ``model_record`` as the model of ``cell`` in ``provenance.json``."""
    write_atomic(out / SPEC_RECORD, record_text(study.record()))
    if cell is not None:
        records = _model_records(out) or {"cells": {}}
        model_record = {"cells": records["cells"] | {cell: model_record}}
    write_atomic(out / MODEL_RECORD, record_text(model_record))


def write_cells(out: Path, study: Study, on_disk: RowsOnDisk, cells, *,
                on_row: Callable[[int], None] | None) -> None:
    """Append the missing rows of every cell, in order, as ``cells`` (an executor) computes them:
    each flushed and fsynced; ``on_row(i)`` after the file's i-th row (from 0, across cells). A bar
    per cell, shown per the current execution's progress."""
    written = sum(len(names) for names in on_disk.names.values())
    with ExitStack() as stack:
        handle = None
        for index in range(on_disk.resume_cell(study), len(study.cells)):
            cell = study.cells[index]
            plan = cells.plan(index)
            done = on_disk.check_cell(cell.name, [name for name, _ in plan.targets])
            if done:
                check_model(out, cell.name, plan.record)
            write_records(out, study, cell.name, plan.record)
            if handle is None:  # only once the rows on disk are known to be this study's
                handle = stack.enter_context(open_results(on_disk, columns(study)))
            rows = cells.rows(index, done, len(plan.targets))
            for row, value in progress_bar(rows, desc=cell.name or "study",
                                           initial=done, total=len(plan.targets)):
                append_row(handle, cell.name, row, plan, value)
                if on_row is not None:
                    on_row(written)
                written += 1


def append_row(handle, cell: str | None, row: int, plan: CellPlan, value: float) -> None:
    """Row ``row`` of a cell, its metric ``value``, appended to ``handle``, flushed and fsynced."""
    name, heads = plan.targets[row]
    fields = format_row(row, name, heads, value, plan.baseline)
    handle.write(_csv_line(fields if cell is None else [cell, *fields]))
    handle.flush()
    os.fsync(handle.fileno())


def run_study(spec_path, out, resume: bool = False, *, progress: bool | None = None,
              on_row: Callable[[int], None] | None = None, executor: str | None = None,
              address: str | None = None, workers: int | None = None) -> Path:
    """Run (or finish, with ``resume``) the study of ``spec_path`` into ``out``; returns results.csv's ``Path``.

    ``on_row(i)`` is called after the file's i-th row (from 0, across a grid's cells) is on disk.
    ``executor``: "local" or "ray" (default: the spec's ``[run].executor``, else local); with Ray,
    ``address`` (a cluster's ``HOST:PORT``; default the spec's, else a local instance, or the one
    this process already runs) and ``workers`` (default: one per GPU, else as many as each node's CPUs
    and memory hold: ``analyses.studies.on_ray.actor_plan``).
    ``[model].impl = "auto"`` leaves the choice to ``load_model``."""
    study, out = load_spec(spec_path), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with directory_lock(out):
        check_out_dir(out, study, resume)
        results = out / RESULTS
        on_disk = read_rows(results, study)
        with open_executor(study, executor, address, workers) as cells, executing(progress=progress):
            write_cells(out, study, on_disk, cells, on_row=on_row)
        plot_study(results, study)
    return results


def grid_figure(frame: pd.DataFrame, title: str) -> Figure:
    """A grid's table: pruning curves (metric against the fraction of heads removed), one per cell,
    when every cell is a cumulative study; else a cell x target heatmap of the effect, both axes in
    row order."""
    if "fraction" in frame:
        fig = new_figure(figsize=(7, 4))
        ax = fig.subplots()
        sns.lineplot(data=frame, x="fraction", y="metric", hue="cell", marker="o", ax=ax)
        ax.set_title(title)
        return fig
    in_order = {key: pd.Categorical(frame[key], categories=frame[key].unique()) for key in ("cell", "target")}
    fig = heatmap(frame.assign(**in_order), "cell", "target", "effect", title, center=0.0)
    width, height = fig.get_size_inches()
    label_inches = 0.08 * frame["cell"].str.len().max()  # cell names can be long (paths): room for them
    fig.set_size_inches(max(width, label_inches + 0.7 * frame["target"].nunique() + 2.5), height)
    return fig


def plot_study(results: Path, study: Study) -> Path:
    frame = pd.read_csv(results, dtype={"layer": "Int64", "head": "Int64", "cell": str})
    specs = [spec for _, spec in study.cells]
    if all(spec.targets == "cumulative" for spec in specs):  # fraction of the cell's heads removed
        cells = frame["cell"] if study.is_grid else pd.Series(0, index=frame.index)
        frame["fraction"] = frame["n_heads"] / frame.groupby(cells)["n_heads"].transform("max").clip(lower=1)
    if study.is_grid:
        figure = grid_figure(frame, f"ablation grid of {len(specs)} cells: effect on the metric")
    else:
        figure = ablation_figure(frame, f"{specs[0].method} ablation of {specs[0].model}: {specs[0].metric}")
    return save_figure(figure, results.with_name("results.png"))
