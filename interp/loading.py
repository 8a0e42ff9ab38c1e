"""``load_model``: one entry point for every model the toolkit looks at (DESIGN 3.3).

Checkpoints of ours are a directory with ``model.safetensors`` and ``config.json``
(``{"format": "interp-gpt/1", "config": {...GPTConfig...}, "tokenizer": "bytes"}``) and optionally
``training.json``. Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from interp.files import write_atomic
from interp.gpt2 import fetch_gpt2, gpt2_bridge, gpt2_to_scratch
from interp.memory import retain_freed_memory_once
from interp.model import GPTConfig, GPTModel
from interp.tokenizer import ByteTokenizer
from interp.errors import UserError

CHECKPOINT_FORMAT = "interp-gpt/1"
IMPLS = ("scratch", "transformer_lens")
_PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")


def toy_checkpoint_dir() -> Path:
    """Where the embedded model ships inside the package."""
    return Path(str(resources.files("interp") / "toy_model"))


def load_model(spec: str | os.PathLike = "toy", impl: str = "scratch", device: str | torch.device | None = None):
    """Load a hooked model.

    Args:
        spec: "toy" (the embedded model, no network), a directory of ours (safetensors + JSON
            config), a local GPT-2 directory saved by ``save_pretrained``, or a hub name such as
            "gpt2" (network needed).
        impl: "scratch" for our ``GPTModel``; "transformer_lens" for a ``TransformerBridge``
            (GPT-2 only).
        device: where to put the model (default: CPU).

    A bridge tunes the allocator at load as GPTModel does at its first cache (``interp.memory``).
    """
    if impl not in IMPLS:
        raise UserError(f"unknown impl {impl!r}; allowed: {', '.join(IMPLS)}")
    path = toy_checkpoint_dir() if str(spec) == "toy" else Path(spec).expanduser()
    if path.suffix in _PICKLE_SUFFIXES:
        raise UserError(f"refusing to load {str(spec)!r}: pickle checkpoints can run code; use safetensors")
    if str(spec) == "toy" and not (path / "model.safetensors").is_file():
        raise UserError("the embedded 'toy' model is not in this installation; run `interp train`")
    if path.is_dir() and _is_our_checkpoint(path):
        if impl != "scratch":
            raise UserError(f"{str(spec)!r} is a from-scratch checkpoint; only impl='scratch' can load it")
        model = load_checkpoint(path)
    elif impl == "scratch":
        model = gpt2_to_scratch(str(spec))
    else:
        model = gpt2_bridge(*fetch_gpt2(str(spec)), name=str(spec))
        retain_freed_memory_once()  # what our run_with_cache does, for a bridge whose caches are not ours
    return model.to(device) if device is not None else model


def _is_our_checkpoint(path: Path) -> bool:
    config = path / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("format") == CHECKPOINT_FORMAT


def save_checkpoint(model: GPTModel, directory: str | os.PathLike, training: dict | None = None) -> Path:
    """Write ``model`` as ``model.safetensors`` + ``config.json`` (+ ``training.json``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if not isinstance(model.tokenizer, ByteTokenizer):
        raise UserError("only models with the byte-level tokenizer can be saved as interp checkpoints")
    state = {name: tensor.detach().cpu().contiguous() for name, tensor in model.state_dict().items()}
    write_atomic(directory / "model.safetensors", lambda tmp: save_file(state, str(tmp)))
    config = {"format": CHECKPOINT_FORMAT, "config": json.loads(model.cfg.to_json()), "tokenizer": "bytes"}
    write_atomic(directory / "config.json", json.dumps(config, indent=2) + "\n")
    if training is not None:
        write_atomic(directory / "training.json", json.dumps(training, indent=2, sort_keys=True) + "\n")
    return directory


def load_checkpoint(directory: str | os.PathLike) -> GPTModel:
    """Load a directory written by ``save_checkpoint`` (safetensors only: nothing is unpickled)."""
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    model = GPTModel(GPTConfig.from_dict(config["config"]), ByteTokenizer())
    model.load_state_dict(load_file(directory / "model.safetensors"))
    model.check_finite()
    return model.eval()

