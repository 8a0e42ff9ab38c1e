"""Hugging Face causal LMs from a local directory (as written by ``save_pretrained``) or a hub id
(``gpt2``, ``EleutherAI/pythia-70m``), loaded strictly: a checkpoint tensor that is missing,
unexpected or mis-shaped is an error, never a silently re-initialised weight.

A hub id is looked up in the local Hugging Face cache first; the hub is asked only when it
answers a TCP probe (else ``transformers`` retries for ~20 s), so offline a hub id fails at once.
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlparse

import torch

from interp.errors import UserError, first_line
from interp.tokenizer import ByteTokenizer

# a hub id: "name" or "org/name", letters, digits, "_", "-", "."
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer_config.json", "tokenizer.model")
# constant buffers older GPT-2 checkpoints saved beside the weights (the causal mask and the -1e4 fill
# value), which the model recomputes: an unexpected tensor of exactly these names is no weight
CONSTANT_BUFFERS = ("attn.bias", "attn.masked_bias")


class OfflineError(UserError):
    """A hub id was given but it is not cached and the hub cannot be reached."""


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connection (False at once when HF_HUB_OFFLINE is set)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


class Located(NamedTuple):
    """Where a model is: what to pass to ``from_pretrained``, and whether to stay on local files."""

    spec: str
    source: str
    local_only: bool


def locate(spec: str) -> Located:
    """``spec`` -> where to load it from (at most one TCP probe of the hub).

    A directory must hold a ``config.json``; anything else must look like a hub id, which is used
    from the local cache when it is there and from the hub only when the hub answers."""
    from huggingface_hub import try_to_load_from_cache

    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{spec!r} has no config.json: not a directory saved by save_pretrained")
        if not isinstance(read_config_json(path).get("model_type"), str):
            raise UserError(f"{path / 'config.json'} names no model_type: not a Hugging Face model saved by "
                            "save_pretrained (nor a checkpoint of ours, whose config.json has \"format\": \"interp-gpt/1\")")
        return Located(spec, str(path), True)
    if path.exists():
        raise UserError(f"model {spec!r} is a file; pass a model directory, a checkpoint of ours or a hub id such as 'gpt2'")
    if not _HUB_ID.match(spec):
        raise UserError(f"no such directory {spec!r} ({path.absolute()} does not exist), and it is no hub id "
                        "such as 'gpt2' or 'EleutherAI/pythia-70m'")
    if isinstance(try_to_load_from_cache(spec, "config.json"), str):  # a local lookup, no request
        return Located(spec, spec, True)
    if hub_reachable():
        return Located(spec, spec, False)
    raise OfflineError(
        f"no such directory {spec!r} ({path.absolute()} does not exist), and as a hub id it is not in the Hugging "
        "Face cache and cannot be fetched: the hub cannot be reached (offline?); save it with save_pretrained where "
        "there is network and pass that directory"
    )


def local_directory(located: Located) -> Path | None:
    """The directory holding a located model's files: the directory given, or a cached hub id's
    snapshot in the Hugging Face cache (the files downloaded so far); None for a hub id not cached."""
    from huggingface_hub import try_to_load_from_cache

    if Path(located.source).is_dir():
        return Path(located.source)
    cached = try_to_load_from_cache(located.source, "config.json") if located.local_only else None
    return Path(cached).parent if isinstance(cached, str) else None


def read_config_json(directory: Path) -> dict:
    """``directory/config.json`` as a JSON object; a one-line error where it is not one."""
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_bytes())
    except json.JSONDecodeError as error:
        raise UserError(f"{path} is not JSON ({error.msg} at line {error.lineno} column {error.colno})") from None
    except UnicodeDecodeError as error:
        raise UserError(f"{path} is not JSON (not UTF-8 text: {error.reason} at byte {error.start})") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} holds a JSON {type(config).__name__}, not an object of settings")
    return config


def hf_config(located: Located):
    """The ``transformers`` config of a located model, read before any weight."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(located.source, local_files_only=located.local_only)
    except (OSError, ValueError) as error:  # an unknown model_type; a hub id the hub does not have
        what = "" if Path(located.source).is_dir() else f"no such directory {located.spec!r}, and as a hub id "
        raise UserError(f"{what}could not read the config of {located.spec!r}: {first_line(error)}") from None


def load_hf(located: Located, device_map: str | dict | None = None, dtype: torch.dtype = torch.float32):
    """``(causal LM in eval mode, in ``dtype``, eager attention; its tokenizer or None)`` of a located
    model, on the CPU or placed by an accelerate ``device_map`` (checked by the caller). Every
    checkpoint tensor must match the model the config describes."""
    from transformers import AutoModelForCausalLM

    spec, source, local_only = located
    placement = {} if device_map is None else {"device_map": device_map}
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            source, local_files_only=local_only, attn_implementation="eager", dtype=dtype,
            output_loading_info=True, **placement)
    except ValueError as error:  # a config class transformers has no causal LM for
        raise UserError(f"{spec!r} is not a causal language model transformers can load: {first_line(error)}") from None
    except RuntimeError as error:
        raise UserError(f"{spec!r} has checkpoint tensors of the wrong shape: {first_line(error)}") from None
    except OSError as error:  # no weights file, or one that cannot be read
        raise UserError(f"could not read the weights of {spec!r}: {first_line(error)}") from None
    unexpected = [name for name in info.get("unexpected_keys") or () if not is_constant_buffer(name)]
    refuse_mismatched_tensors(spec, info.get("missing_keys") or (), unexpected, info.get("mismatched_keys") or (),
                              errors=info.get("error_msgs") or ())
    return model.eval(), load_tokenizer(located)


def has_tokenizer(located: Located) -> bool:
    """Whether a located model comes with a tokenizer: a hub id always; a directory where it holds
    one of ``TOKENIZER_FILES``."""
    return not Path(located.source).is_dir() or any((Path(located.source) / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(located: Located):
    """The Hugging Face tokenizer of a located model, or None where it has none (``has_tokenizer``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(located.source, local_files_only=located.local_only) \
        if has_tokenizer(located) else None


def refuse_missing_tokenizer(located: Located, vocab_size: int) -> None:
    """Refuse, in one line, a directory without tokenizer files whose vocabulary is not the byte
    tokenizer's (257 tokens: bytes 0..255 and the start token 256): read with the byte tokenizer
    instead, its text and start token would silently be other tokens."""
    if not has_tokenizer(located) and vocab_size != ByteTokenizer.vocab_size:
        raise UserError(f"{located.spec!r} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}) and its "
                        f"{vocab_size}-token vocabulary is not the byte tokenizer's ({ByteTokenizer.vocab_size}); "
                        "save the model's tokenizer there (tokenizer.save_pretrained)")


def is_constant_buffer(name: str) -> bool:
    """Whether a checkpoint tensor's name ends in one of ``CONSTANT_BUFFERS`` (``transformer.h.3.attn.bias``)."""
    return any(name == buffer or name.endswith("." + buffer) for buffer in CONSTANT_BUFFERS)


def refuse_mismatched_tensors(source: str, missing, unexpected, misshaped, errors=()) -> None:
    """Refuse, in one line, a checkpoint whose tensors do not match its model one for one (any
    tensor name missing, unexpected or mis-shaped, or a loader error); for Hugging Face directories
    and our own checkpoints alike."""
    kinds = {"missing": sorted(missing), "unexpected": sorted(unexpected), "mis-shaped": sorted(misshaped)}
    found = [f"{kind} {names[:3]}{' ...' if len(names) > 3 else ''}" for kind, names in kinds.items() if names]
    if found or errors:
        raise UserError(f"checkpoint {source!r} does not match its config (tensors {'; '.join(found) or list(errors)}); "
                        "refusing to analyse re-initialised weights")
