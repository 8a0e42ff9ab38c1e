"""The record of the model in each output's ``meta.json`` (the spec it was
loaded from, its family, the implementation that ran it, its dtype and device, a hash of its
weights, whether its texts began with the start token and why, the hook self-test's verdicts and
the package versions)."""

from __future__ import annotations

import json
import platform
from importlib import metadata
from pathlib import Path

from analyses.core.hook_check import describe
from interp.files import write_atomic
from interp.tokenizer import start_token_setting

VERSIONED = ("interp", "torch", "transformer-lens", "transformers", "matplotlib", "seaborn", "pandas")


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in VERSIONED:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def model_meta(model, spec: str) -> dict:
    """For an output's meta.json: ``{"model": spec, "family", "impl", "weights_hash"}``, the hook
    self-test's verdicts (``analyses.core.hook_check.describe``), how the model ran (``run_setting``)
    and the package versions."""
    return {"model": str(spec), **describe(model), **run_setting(model), "versions": versions()}


def run_setting(model) -> dict:
    """How ``model`` runs, each part of which changes its numbers: ``{"dtype", "precision"
    (``GPTModel.set_precision``; float32 for the bridge), "device", "start_token": {"prepend_bos",
    "source"}}`` (whether texts and probes begin with the start token, and where that setting came
    from: ``interp.tokenizer.START_TOKEN_SOURCES``)."""
    weight = next(model.parameters())
    prepend, source = start_token_setting(model)
    return {"dtype": str(weight.dtype).removeprefix("torch."), "precision": getattr(model.cfg, "precision", "float32"),
            "device": str(weight.device), "start_token": {"prepend_bos": prepend, "source": source}}


def write_meta(directory: str | Path, meta: dict) -> Path:
    """``directory/meta.json`` (sorted keys, atomically)."""
    return write_atomic(Path(directory) / "meta.json", json.dumps(meta, indent=2, sort_keys=True) + "\n")
