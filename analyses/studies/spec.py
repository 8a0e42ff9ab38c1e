"""The TOML spec of a scripted ablation study (architecture §4.5), parsed and checked key by key.

```toml
[run]                       # optional
executor = "local"          # local | ray
memory_mb = 1024            # what an analysis may add beyond the weights
[model]
spec = "toy"                # anything load_model takes; a relative path is the spec file's
impl = "auto"               # auto (load_model's choice) | scratch | transformer_lens
dtype = "float32"           # float32 | bfloat16 | float16
device = "cpu"              # cpu | cuda | cuda:N | mps (the local executor's; Ray gives each actor its own)
prepend_bos = true          # begin every prompt with the start token (absent: the model's own setting)
[prompts]
kind = "repeated"           # repeated | text (with file = "prompts.txt", one prompt per line)
n = 64
seed = 0
seq_len = 64                # repeated only; default min(n_ctx, 128)
[ablation]
method = "mean"             # zero | mean (leave-one-out) | mean_aligned | resample
targets = "each_head"       # each_head | each_layer | each_mlp | each_mlp_by_position | cumulative
                            # | [[1, 4], [1, 10], "mlp2"]  (heads as [layer, head], MLPs as "mlpL", "mlpL@P")
preserve_patterns = false
seed = 0                    # resample draws
[metric]
kind = "repeat_loss"        # loss | repeat_loss | logit_diff (with correct = "...", incorrect = "...")
```

A list of components as ``targets`` (heads as ``[layer, head]``, MLP outputs as ``"mlp2"``, or
``"mlp2@5"`` at position 5 only) ablates each alone, then (for two or more) all of them together.
``each_mlp`` ablates each layer's MLP output at every position, ``each_mlp_by_position`` at each
position in turn (rows ``L{l} MLP`` and ``L{l} MLP@{p}``; their ``n_heads`` is 0).

**Grids.** A list in place of any other value (``spec = ["toy", "runs/ckpt"]``, ``seed = [0, 1]``,
``method = ["zero", "mean"]``; for ``targets``, a list of kinds or of head lists) makes a grid: one
cell per combination, in the order of the keys above and then of the values listed, each a complete
study named ``"spec=toy method=zero"`` (``section.key`` where the key alone is ambiguous:
``prompts.seed``, ``ablation.seed``, ``prompts.kind``, ``metric.kind``).

**[run]** says how the study runs: ``executor = "local" | "ray"``, ``address`` (a Ray cluster,
``HOST:PORT`` or ``ray://HOST:PORT``; default a local one), ``workers`` (default one per GPU, else as
many as each node's CPUs and memory hold), ``memory_mb`` (each analysis's budget beyond the weights).
The executor, address and workers change no number, so a run may be resumed by another executor;
``memory_mb`` does (the budget cuts the prompts into chunks, whose sums round differently), so it
is part of the study's identity (``Study.record``), as ``[model].dtype`` is (results in bfloat16
are not those in float32). ``[model].device`` (the local executor's; Ray gives each actor its own)
is not a grid axis: the device the rows ran on is recorded with the model (``provenance.json``,
``analyses.studies.runner``), and a resume on another device is refused.

``[model].prepend_bos`` (``true`` | ``false``) says whether every prompt, text or probe, begins with
the model's start token, as ``--prepend-bos/--no-prepend-bos`` does on the command line
(``interp.tokenizer.set_start_token``, source ``"study spec"``); absent, the model's own setting
(its tokenizer's, else its family's). It is part of the study's identity.

Every mistake is a one-line ``ValueError`` naming the key, e.g. ``[ablation].method``.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from dataclasses import asdict, dataclass
from itertools import product
from pathlib import Path
from typing import NamedTuple

from analyses.interventions.ablation import FROM_OTHER_PROMPTS, METHODS, MLP_TEXT, TARGET_KINDS as SWEEP_KINDS
from analyses.core.budget import DEFAULT_MEMORY_MB
from analyses.core.probes import MIN_SEQ_LEN
from analyses.core.tokens import read_text
from interp.errors import UserError
from interp.loading import DTYPES, EMBEDDED, SHIPPED

TARGET_KINDS = (*SWEEP_KINDS, "cumulative")
PROMPT_KINDS = ("repeated", "text")
METRIC_KINDS = ("loss", "repeat_loss", "logit_diff")
IMPLS = ("auto", "scratch", "transformer_lens")
EXECUTORS = ("local", "ray")

# section -> its keys, in the order that orders a grid's cells
_ALLOWED = {
    "model": ("spec", "impl", "dtype", "prepend_bos"),
    "prompts": ("kind", "n", "seed", "seq_len", "file"),
    "ablation": ("method", "targets", "preserve_patterns", "seed"),
    "metric": ("kind", "correct", "incorrect"),
}
_RUN_KEYS = ("executor", "address", "workers", "memory_mb")
_MODEL_RUN_KEYS = ("device",)  # [model] keys that say where, not what: outside the grid and the identity


@dataclass(frozen=True)
class StudySpec:
    """One cell of a study: one model, one set of prompts, one ablation, one metric."""

    model: str
    impl: str
    prompt_kind: str
    n_prompts: int
    prompt_seed: int
    seq_len: int | None
    text_file: str | None
    method: str
    targets: str | tuple[tuple[int, int] | str, ...]  # a kind, or heads (layer, head) and MLPs "mlpL[@P]"
    preserve_patterns: bool
    ablation_seed: int
    metric: str
    correct: str | None
    incorrect: str | None
    dtype: str = "float32"
    prepend_bos: bool | None = None  # None: the model's own setting

    def as_dict(self) -> dict:
        return asdict(self)


class Cell(NamedTuple):
    """A grid cell: its name (None for a study that is not a grid) and its spec."""

    name: str | None
    spec: StudySpec


@dataclass(frozen=True)
class Study:
    """A parsed spec file: its cells in row order (one, unnamed, unless it is a grid) and how to run
    them (``executor``, ``address``, ``workers``: see the module docstring)."""

    cells: tuple[Cell, ...]
    executor: str = "local"
    address: str | None = None
    workers: int | None = None
    device: str | None = None
    memory_mb: float = DEFAULT_MEMORY_MB

    @property
    def is_grid(self) -> bool:
        return self.cells[0].name is not None

    def record(self) -> dict:
        """What identifies the study's results (``spec.json``): the cells' specs, the contents of the
        prompt files they read (``inputs_record``) and ``memory_mb`` (the budget cuts the prompts into
        chunks, whose sums round differently); not the executor, which changes no number."""
        if not self.is_grid:
            return inputs_record(self.cells[0].spec) | {"memory_mb": self.memory_mb}
        return {"cells": [{"cell": name, "spec": inputs_record(spec)} for name, spec in self.cells],
                "memory_mb": self.memory_mb}


def inputs_record(spec: StudySpec) -> dict:
    """A cell's spec and, where it reads a prompt file, the SHA-256 of the file's bytes
    (``text_file_sha256``): the spec names the file by its path, so an edited file changes only this."""
    record = spec.as_dict()
    if spec.text_file is not None:
        path = Path(spec.text_file)
        if not path.is_file():
            raise UserError(f"[prompts].file {spec.text_file!r} does not exist")
        record["text_file_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return record


def _fail(key: str, problem: str):
    raise UserError(f"study spec: {key} {problem}")


def _get(table: dict, section: str, key: str, kind, default=..., choices=None):
    name = f"[{section}].{key}"
    if key not in table:
        if default is ...:
            _fail(name, "is missing")
        return default
    value = table[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        _fail(name, f"must be an integer, got {value!r}")
    if kind is bool and not isinstance(value, bool):
        _fail(name, f"must be true or false, got {value!r}")
    if kind is not int and not isinstance(value, kind):
        _fail(name, f"must be a {getattr(kind, '__name__', 'number')}, got {value!r}")
    if choices is not None and value not in choices:
        _fail(name, f"is {value!r}; allowed: {', '.join(choices)}")
    return value


def _targets(value) -> str | tuple[tuple[int, int] | str, ...]:
    name = "[ablation].targets"
    if isinstance(value, str):
        if value not in TARGET_KINDS:
            _fail(name, f"is {value!r}; allowed: {', '.join(TARGET_KINDS)}, or a list of [layer, head] pairs "
                        "and \"mlpL\" MLPs")
        return value
    if not isinstance(value, list) or not value:
        _fail(name, f"must be one of {', '.join(TARGET_KINDS)} or a non-empty list of [layer, head] pairs and "
                    f"\"mlpL\" MLPs, got {value!r}")
    components = []
    for item in value:
        if isinstance(item, str) and MLP_TEXT.fullmatch(item):
            components.append(item)
            continue
        if not (isinstance(item, list) and len(item) == 2 and all(isinstance(v, int) and v >= 0 for v in item)):
            _fail(name, f"has {item!r}; each entry must be a [layer, head] pair of non-negative integers or an "
                        "MLP \"mlpL\" (\"mlpL@P\" at position P)")
        components.append((item[0], item[1]))
    return tuple(components)


def _check_layout(data: dict) -> dict[str, dict]:
    """The spec's tables by section (missing ones empty), with unknown sections and keys refused."""
    allowed = _ALLOWED | {"run": _RUN_KEYS, "model": _ALLOWED["model"] + _MODEL_RUN_KEYS}
    for section in data:
        if section not in allowed:
            _fail(f"[{section}]", f"is not a known section; allowed: {', '.join(f'[{s}]' for s in allowed)}")
    tables = {}
    for section, keys in allowed.items():
        table = data.get(section, {})
        if not isinstance(table, dict):
            _fail(f"[{section}]", "must be a table")
        for key in table:
            if key not in keys:
                _fail(f"[{section}].{key}", f"is not a known key; allowed: {', '.join(sorted(keys))}")
        tables[section] = table
    return tables


def parse_spec(data: dict, base_dir: Path = Path(".")) -> StudySpec:
    """A parsed TOML document without lists of values -> ``StudySpec``; relative ``[prompts].file``
    and ``[model].spec`` paths are resolved against ``base_dir`` (``_model_spec``: names and hub ids
    stay as they are). ``[run]`` is not read here (see ``parse_study``)."""
    tables = _check_layout(data)
    model, prompts, ablation, metric = (tables[s] for s in ("model", "prompts", "ablation", "metric"))
    prompt_kind = _get(prompts, "prompts", "kind", str, "repeated", PROMPT_KINDS)
    n_prompts = _get(prompts, "prompts", "n", int, 64)
    if n_prompts < 1:
        _fail("[prompts].n", f"must be >= 1, got {n_prompts}")
    seq_len = _get(prompts, "prompts", "seq_len", int, None)
    if seq_len is not None and seq_len < MIN_SEQ_LEN:
        _fail("[prompts].seq_len", f"must be >= {MIN_SEQ_LEN} (the start token, a prefix and two copies of a segment), "
                                   f"got {seq_len}")
    text_file = _get(prompts, "prompts", "file", str, None if prompt_kind == "repeated" else ...)
    if text_file is not None:
        text_file = str((base_dir / text_file).resolve())
    metric_kind = _get(metric, "metric", "kind", str, "repeat_loss" if prompt_kind == "repeated" else "loss", METRIC_KINDS)
    if metric_kind == "repeat_loss" and prompt_kind != "repeated":
        _fail("[metric].kind", "is 'repeat_loss', which needs [prompts].kind = 'repeated'")
    needs_tokens = metric_kind == "logit_diff"
    spec = StudySpec(
        model=_model_spec(_get(model, "model", "spec", str, "toy"), base_dir),
        impl=_get(model, "model", "impl", str, "auto", IMPLS),
        dtype=_get(model, "model", "dtype", str, "float32", tuple(DTYPES)),
        prepend_bos=_get(model, "model", "prepend_bos", bool, None),
        prompt_kind=prompt_kind,
        n_prompts=n_prompts,
        prompt_seed=_get(prompts, "prompts", "seed", int, 0),
        seq_len=seq_len,
        text_file=text_file,
        method=_get(ablation, "ablation", "method", str, ..., METHODS),
        targets=_targets(ablation.get("targets", "each_head")),
        preserve_patterns=_get(ablation, "ablation", "preserve_patterns", bool, False),
        ablation_seed=_get(ablation, "ablation", "seed", int, 0),
        metric=metric_kind,
        correct=_get(metric, "metric", "correct", str, ... if needs_tokens else None),
        incorrect=_get(metric, "metric", "incorrect", str, ... if needs_tokens else None),
    )
    if spec.method in FROM_OTHER_PROMPTS and n_prompts < 2:
        _fail("[prompts].n", f"is {n_prompts}, but at least 2 prompts are needed, since {FROM_OTHER_PROMPTS[spec.method]}")
    return spec


def _model_spec(value: str, base_dir: Path) -> str:
    """``[model].spec`` as ``load_model`` is to take it wherever the study runs from: relative paths
    are the spec file's, as ``[prompts].file`` is. A model name (``toy``, ``code``, ``smollm2``)
    stays as it is; path syntax (absolute, or beginning with ``./``, ``../`` or ``~``) and any value
    that names a file or directory under ``base_dir`` becomes that path, absolute; anything else is a
    hub id and stays as it is -- unless it names a file or directory under the current directory,
    which ``load_model`` would silently take: that is refused in one line."""
    if value in EMBEDDED or value in SHIPPED:
        return value
    path = Path(value).expanduser()
    syntax = path.is_absolute() or value.startswith(("~", "./", "../")) or value in (".", "..")
    if syntax or (base_dir / path).exists():
        return str((base_dir / path).resolve())
    if path.exists():
        _fail("[model].spec", f"{value!r} is no path under the spec's directory {base_dir.resolve()}, but is one under "
                              f"the current directory; relative paths are read from the spec's directory: write "
                              f"the path relative to it, or an absolute one")
    return value


def _is_head_list(value: list) -> bool:
    """Whether a ``targets`` list is one value (a list of [layer, head] pairs and "mlpL" MLPs)
    rather than a grid (a list of kinds or of component lists)."""
    return not any((isinstance(item, str) and not MLP_TEXT.fullmatch(item))
                   or (isinstance(item, list) and item and isinstance(item[0], (list, str))) for item in value)


def _axis_name(section: str, key: str) -> str:
    """A grid axis as cell names show it: the key, or ``section.key`` where the key is ambiguous."""
    ambiguous = sum(key in keys for keys in _ALLOWED.values()) > 1
    return f"{section}.{key}" if ambiguous else key


def _value_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _grid_axes(tables: dict[str, dict]) -> list[tuple[str, str, list]]:
    """(section, key, values) of every key given a list of values, in ``_ALLOWED``'s order."""
    axes = []
    for section, keys in _ALLOWED.items():
        for key in keys:
            value = tables[section].get(key)
            if not isinstance(value, list) or (section, key) == ("ablation", "targets") and _is_head_list(value):
                continue
            texts = [_value_text(v) for v in value]
            if not value:
                _fail(f"[{section}].{key}", "is an empty list; a grid needs at least one value")
            if len(set(texts)) < len(texts):
                _fail(f"[{section}].{key}", f"lists a value twice ({value!r}); each grid cell must differ")
            axes.append((section, key, value))
    return axes


def _cells(data: dict, tables: dict[str, dict], base_dir: Path) -> tuple[Cell, ...]:
    """Every combination of the grid axes' values, in order, as named cells (one unnamed cell
    when there is no grid)."""
    axes = _grid_axes(tables)
    if not axes:
        return (Cell(None, parse_spec(data, base_dir)),)
    cells = []
    for values in product(*(values for _, _, values in axes)):
        cell_data = {section: dict(table) for section, table in data.items()}
        for (section, key, _), value in zip(axes, values):
            cell_data[section][key] = value
        name = " ".join(f"{_axis_name(section, key)}={_value_text(value)}" for (section, key, _), value in zip(axes, values))
        cells.append(Cell(name, parse_spec(cell_data, base_dir)))
    return tuple(cells)


def parse_study(data: dict, base_dir: Path = Path(".")) -> Study:
    """A parsed TOML document -> ``Study``: its cells (a grid where values are lists) and ``[run]``."""
    tables = _check_layout(data)
    run = tables["run"]
    workers = _get(run, "run", "workers", int, None)
    if workers is not None and workers < 1:
        _fail("[run].workers", f"must be >= 1, got {workers}")
    memory_mb = _get(run, "run", "memory_mb", (int, float), DEFAULT_MEMORY_MB)
    if isinstance(memory_mb, bool) or not memory_mb > 0:
        _fail("[run].memory_mb", f"must be a number above 0, got {memory_mb!r}")
    cell_data = {s: t for s, t in data.items() if s != "run"}
    if "model" in cell_data:
        cell_data["model"] = {k: v for k, v in cell_data["model"].items() if k not in _MODEL_RUN_KEYS}
    return Study(
        cells=_cells(cell_data, tables, base_dir),
        executor=_get(run, "run", "executor", str, "local", EXECUTORS),
        address=_get(run, "run", "address", str, None),
        workers=workers,
        device=_get(tables["model"], "model", "device", str, None),
        memory_mb=float(memory_mb),
    )


def load_spec(path) -> Study:
    """The study spec file at ``path``, parsed and checked (one-line ``UserError`` on any mistake)."""
    path = Path(path)
    text = read_text(path, "study spec")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise UserError(f"study spec: {path} is not valid TOML: {error}") from None
    return parse_study(data, path.parent)
