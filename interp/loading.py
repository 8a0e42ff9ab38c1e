"""``load_model``: one entry point for every model the toolkit looks at (DESIGN 3.3).

Checkpoints of ours are a directory with ``model.safetensors`` and ``config.json``
(``{"format": "interp-gpt/1", "config": {...GPTConfig...}, "tokenizer": "bytes"}``, or a fixed
vocabulary: ``"tokenizer": {"kind": "vocab", ...}``, ``VocabTokenizer.to_dict``) and optionally
``training.json``. Nothing is ever unpickled.
"""

from __future__ import annotations

import importlib.util
import json
import os
from importlib import resources
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from interp.bridge import boot_bridge
from interp.convert import check_scratch_family, from_hf, scratch_families
from interp.errors import UserError
from interp.files import write_atomic
from interp.hub import hf_config, load_hf, locate, read_config_json, refuse_mismatched_tensors
from interp.model import GPTConfig, GPTModel
from interp.tokenizer import ByteTokenizer, VocabTokenizer

CHECKPOINT_FORMAT = "interp-gpt/1"
IMPLS = ("scratch", "transformer_lens")
DEVICE_MAP_KINDS = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's strategies
_PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")


def toy_checkpoint_dir() -> Path:
    """Where the embedded model ships inside the package."""
    return Path(str(resources.files("interp") / "toy_model"))


# the embedded models: spec -> (package folder, the `interp train` arguments that make it)
EMBEDDED = {"toy": ("toy_model", ""), "code": ("code_model", " --preset code")}


def load_model(spec: str | os.PathLike = "toy", impl: str | None = None, device: str | torch.device | None = None,
               device_map: str | dict | None = None):
    """Load a hooked model.

    Args:
        spec: "toy" (the embedded model, no network), "code" (the embedded model trained on Python
            source only, no network), a checkpoint directory of ours (safetensors +
            JSON config), a Hugging Face directory saved by ``save_pretrained``, or a hub id
            ("gpt2", "EleutherAI/pythia-70m"; network or the local HF cache needed). A Hugging Face
            model is read by its config's ``model_type``; every checkpoint tensor must match it.
        impl: None (the from-scratch ``GPTModel`` where it implements the family, see
            ``interp.convert.scratch_families``, else the TransformerLens bridge; always the bridge
            with a ``device_map``), "scratch" or "transformer_lens" (a ``TransformerBridge``: any
            family the bridge supports).
        device: where to put the model (default: CPU).
        device_map: instead of ``device``, for a model larger than one device: an accelerate device
            map ("auto", "balanced", "balanced_low_0", "sequential", or ``{module name: device}``,
            e.g. ``{"": "cpu"}``, ``{"transformer.h.0": 0, ...}``) with which transformers places the
            Hugging Face model's layers as it loads them; the TransformerLens bridge then runs it
            where it lies (TransformerLens's multi-device loading). Needs ``accelerate``. The
            from-scratch model runs on one device and refuses it.

    The model's family, impl and weights hash are given by ``interp.provenance(model)``.
    A bridge tunes the allocator at load as GPTModel does at its first cache (``interp.memory``).
    """
    if impl is not None and impl not in IMPLS:
        raise UserError(f"unknown impl {impl!r}; allowed: {', '.join(IMPLS)} (or None to choose by family)")
    spec = str(spec)
    if device_map is not None:
        check_device_map(spec, impl, device, device_map)
    path = Path(str(resources.files("interp") / EMBEDDED[spec][0])) if spec in EMBEDDED else Path(spec).expanduser()
    if path.suffix in _PICKLE_SUFFIXES:
        raise UserError(f"refusing to load {spec!r}: pickle checkpoints can run code; use safetensors")
    if spec in EMBEDDED and not (path / "model.safetensors").is_file():
        raise UserError(f"the embedded {spec!r} model is not in this installation; run `interp train{EMBEDDED[spec][1]}`")
    if path.is_dir() and _is_our_checkpoint(path):
        if impl == "transformer_lens":
            raise UserError(f"{spec!r} is a from-scratch checkpoint; only impl='scratch' can load it")
        if device_map is not None:
            raise UserError(f"{spec!r} is a from-scratch checkpoint, which runs on one device: pass device=..., "
                            "not device_map")
        model = load_checkpoint(path)
    else:
        model = _load_hf_model(spec, impl, device_map)
    return model.to(device) if device is not None else model


def check_device_map(spec: str, impl: str | None, device, device_map) -> None:
    """Refuse, in one line, a ``device_map`` that cannot be honoured (before anything is read)."""
    if device is not None:
        raise UserError(f"pass device ({device!r}) or device_map ({device_map!r}), not both")
    if impl == "scratch":
        raise UserError(f"device_map {device_map!r}: the from-scratch model (impl='scratch') runs on one device; "
                        "pass device=..., or impl='transformer_lens' to spread the model over devices")
    if not (device_map in DEVICE_MAP_KINDS or isinstance(device_map, dict) and device_map):
        raise UserError(f"device_map {device_map!r}: allowed: {', '.join(DEVICE_MAP_KINDS)}, or a non-empty dict "
                        "of module name -> device")
    if importlib.util.find_spec("accelerate") is None:
        raise UserError(f"device_map for {spec!r} needs the accelerate package: pip install accelerate")


def _load_hf_model(spec: str, impl: str | None, device_map: str | dict | None = None):
    """A Hugging Face directory or hub id as the chosen (or the family's default) implementation;
    a bridge with a ``device_map``."""
    located = locate(spec)
    family = hf_config(located).model_type
    if impl is None:
        impl = "scratch" if family in scratch_families() and device_map is None else "transformer_lens"
    if impl == "scratch":
        check_scratch_family(family)  # before reading any weight
    hf_model, tokenizer = load_hf(located, device_map=device_map)
    if impl == "scratch":
        return from_hf(hf_model, tokenizer)
    return boot_bridge(hf_model, tokenizer, name=spec, copy=False)  # nothing else holds hf_model


def _is_our_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() and read_config_json(path).get("format") == CHECKPOINT_FORMAT


def save_checkpoint(model: GPTModel, directory: str | os.PathLike, training: dict | None = None) -> Path:
    """Write ``model`` as ``model.safetensors`` + ``config.json`` (+ ``training.json``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if not isinstance(model.tokenizer, (ByteTokenizer, VocabTokenizer)):
        raise UserError("only models with the byte-level tokenizer or a fixed vocabulary (VocabTokenizer) can be "
                        "saved as interp checkpoints")
    state = {name: tensor.detach().cpu().contiguous() for name, tensor in model.state_dict().items()}
    write_atomic(directory / "model.safetensors", lambda tmp: save_file(state, str(tmp)))
    tokenizer = "bytes" if isinstance(model.tokenizer, ByteTokenizer) else model.tokenizer.to_dict()
    config = {"format": CHECKPOINT_FORMAT, "config": json.loads(model.cfg.to_json()), "tokenizer": tokenizer}
    write_atomic(directory / "config.json", json.dumps(config, indent=2) + "\n")
    if training is not None:
        write_atomic(directory / "training.json", json.dumps(training, indent=2, sort_keys=True) + "\n")
    return directory


def load_checkpoint(directory: str | os.PathLike) -> GPTModel:
    """Load a directory written by ``save_checkpoint`` (safetensors only: nothing is unpickled)."""
    directory = Path(directory)
    config = read_config_json(directory)
    if not isinstance(config.get("config"), dict):
        raise UserError(f"{directory / 'config.json'} has no \"config\" object of GPTConfig fields")
    weights = directory / "model.safetensors"
    if not weights.is_file():
        raise UserError(f"{directory} is a checkpoint of ours (config.json format {CHECKPOINT_FORMAT!r}) but has no "
                        "model.safetensors")
    tokenizer = config.get("tokenizer", "bytes")
    tokenizer = ByteTokenizer() if tokenizer == "bytes" else VocabTokenizer.from_dict(tokenizer)
    model = GPTModel(GPTConfig.from_dict(config["config"]), tokenizer)
    try:
        state = load_file(weights)
    except SafetensorError as error:
        raise UserError(f"{weights} is not a readable safetensors file: {error}") from None
    check_tensors(str(directory), state, model.state_dict())
    model.load_state_dict(state)
    model.check_finite()
    return model.eval()


def check_tensors(source: str, found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Refuse a checkpoint whose tensors are not exactly the model's: none missing, none
    unexpected, every shape equal."""
    misshaped = [name for name in set(found) & set(expected) if found[name].shape != expected[name].shape]
    refuse_mismatched_tensors(source, set(expected) - set(found), set(found) - set(expected), misshaped)
