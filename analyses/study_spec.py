"""The TOML spec of a scripted ablation study (DESIGN 4.5), parsed and checked key by key.

```toml
[model]
spec = "toy"                # anything load_model takes
impl = "auto"               # auto (load_model's choice) | scratch | transformer_lens
[prompts]
kind = "repeated"           # repeated | text (with file = "prompts.txt", one prompt per line)
n = 64
seed = 0
seq_len = 64                # repeated only; default min(n_ctx, 128)
[ablation]
method = "mean"             # zero | mean | resample
targets = "each_head"       # each_head | each_layer | cumulative | [[1, 4], [1, 10]]
preserve_patterns = false
seed = 0                    # resample draws
[metric]
kind = "repeat_loss"        # loss | repeat_loss | logit_diff (with correct = "...", incorrect = "...")
```

A list of heads as ``targets`` ablates each listed head alone, then (for two or more) all of them together.
Every mistake is a one-line ``ValueError`` naming the key, e.g. ``[ablation].method``.
"""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

from analyses.ablation import METHODS
from interp.errors import UserError

TARGET_KINDS = ("each_head", "each_layer", "cumulative")
PROMPT_KINDS = ("repeated", "text")
METRIC_KINDS = ("loss", "repeat_loss", "logit_diff")
IMPLS = ("auto", "scratch", "transformer_lens")

_ALLOWED = {
    "model": {"spec", "impl"},
    "prompts": {"kind", "n", "seed", "seq_len", "file"},
    "ablation": {"method", "targets", "preserve_patterns", "seed"},
    "metric": {"kind", "correct", "incorrect"},
}


@dataclass(frozen=True)
class StudySpec:
    model: str
    impl: str
    prompt_kind: str
    n_prompts: int
    prompt_seed: int
    seq_len: int | None
    text_file: str | None
    method: str
    targets: str | tuple[tuple[int, int], ...]
    preserve_patterns: bool
    ablation_seed: int
    metric: str
    correct: str | None
    incorrect: str | None

    def as_dict(self) -> dict:
        return asdict(self)


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
    if kind is not int and not isinstance(value, kind):
        _fail(name, f"must be a {kind.__name__}, got {value!r}")
    if choices is not None and value not in choices:
        _fail(name, f"is {value!r}; allowed: {', '.join(choices)}")
    return value


def _targets(value) -> str | tuple[tuple[int, int], ...]:
    name = "[ablation].targets"
    if isinstance(value, str):
        if value not in TARGET_KINDS:
            _fail(name, f"is {value!r}; allowed: {', '.join(TARGET_KINDS)}, or a list of [layer, head] pairs")
        return value
    if not isinstance(value, list) or not value:
        _fail(name, f"must be one of {', '.join(TARGET_KINDS)} or a non-empty list of [layer, head] pairs, got {value!r}")
    heads = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and all(isinstance(v, int) and v >= 0 for v in item)):
            _fail(name, f"has {item!r}; each entry must be a [layer, head] pair of non-negative integers")
        heads.append((item[0], item[1]))
    return tuple(heads)


def parse_spec(data: dict, base_dir: Path = Path(".")) -> StudySpec:
    """A parsed TOML document -> ``StudySpec``; relative ``[prompts].file`` is resolved against ``base_dir``."""
    for section in data:
        if section not in _ALLOWED:
            _fail(f"[{section}]", f"is not a known section; allowed: {', '.join(f'[{s}]' for s in _ALLOWED)}")
    tables = {}
    for section, keys in _ALLOWED.items():
        table = data.get(section, {})
        if not isinstance(table, dict):
            _fail(f"[{section}]", "must be a table")
        for key in table:
            if key not in keys:
                _fail(f"[{section}].{key}", f"is not a known key; allowed: {', '.join(sorted(keys))}")
        tables[section] = table
    model, prompts, ablation, metric = (tables[s] for s in ("model", "prompts", "ablation", "metric"))
    prompt_kind = _get(prompts, "prompts", "kind", str, "repeated", PROMPT_KINDS)
    n_prompts = _get(prompts, "prompts", "n", int, 64)
    if n_prompts < 1:
        _fail("[prompts].n", f"must be >= 1, got {n_prompts}")
    seq_len = _get(prompts, "prompts", "seq_len", int, None)
    text_file = _get(prompts, "prompts", "file", str, None if prompt_kind == "repeated" else ...)
    if text_file is not None:
        text_file = str((base_dir / text_file).resolve())
    metric_kind = _get(metric, "metric", "kind", str, "repeat_loss" if prompt_kind == "repeated" else "loss", METRIC_KINDS)
    if metric_kind == "repeat_loss" and prompt_kind != "repeated":
        _fail("[metric].kind", "is 'repeat_loss', which needs [prompts].kind = 'repeated'")
    needs_tokens = metric_kind == "logit_diff"
    return StudySpec(
        model=_get(model, "model", "spec", str, "toy"),
        impl=_get(model, "model", "impl", str, "auto", IMPLS),
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


def load_spec(path) -> StudySpec:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"study spec {str(path)!r} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise UserError(f"study spec: {path} is not valid TOML: {error}") from None
    return parse_spec(data, path.parent)
