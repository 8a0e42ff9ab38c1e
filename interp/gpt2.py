"""GPT-2 from ``transformers``: fetching it (local directory or hub) and converting its weights.

HF's ``Conv1D`` stores weights as (in, out); ``nn.Linear`` as (out, in), hence the transposes.
``c_attn`` packs query, key and value side by side on the output axis.
"""

from __future__ import annotations

import copy
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch

from interp.tokenizer import HFTokenizer
from interp.errors import UserError

# GPT-2 options our architecture does not implement: refuse rather than silently differ.
_UNSUPPORTED = {
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
}


class OfflineError(UserError):
    """A hub name was given but the hub cannot be reached."""


def fetch_gpt2(source: str):
    """Load ``(GPT2LMHeadModel in eval mode with eager attention, HF tokenizer or None)``.

    ``source`` is a local directory (as written by ``save_pretrained``) or a hub name.
    """
    from transformers import AutoTokenizer, GPT2LMHeadModel

    local = Path(source).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise UserError(f"{str(local)!r} has no config.json: not a directory saved by save_pretrained")
        model = GPT2LMHeadModel.from_pretrained(local, attn_implementation="eager")
        has_tokenizer = any((local / f).is_file() for f in ("tokenizer.json", "vocab.json", "tokenizer_config.json"))
        tokenizer = AutoTokenizer.from_pretrained(local) if has_tokenizer else None
        return model.eval(), tokenizer
    if local.exists() or os.sep in source or source.startswith("."):
        raise UserError(f"model path {source!r} is not a directory")
    # The local Hugging Face cache first; the hub only when it answers (else HF retries for ~20 s).
    for local_only in (True, False):
        if not local_only and not hub_reachable():
            break
        try:
            model = GPT2LMHeadModel.from_pretrained(source, attn_implementation="eager", local_files_only=local_only)
            return model.eval(), AutoTokenizer.from_pretrained(source, local_files_only=local_only)
        except OSError:
            continue
    raise OfflineError(
        f"could not load {source!r}: it is not a local directory, not in the Hugging Face cache, and the hub "
        "cannot be reached (no network?); save it with save_pretrained where there is network and pass that directory"
    )


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


def gpt2_to_scratch(source, tokenizer=None):
    """A ``GPTModel`` with the weights of ``source`` (a ``GPT2LMHeadModel``, directory or hub name)."""
    from interp.model import GPTConfig, GPTModel

    if isinstance(source, (str, os.PathLike)):
        source, fetched_tokenizer = fetch_gpt2(str(source))
        tokenizer = tokenizer if tokenizer is not None else fetched_tokenizer
    hf_cfg = source.config
    for option, supported in _UNSUPPORTED.items():
        if getattr(hf_cfg, option, supported) != supported:
            raise UserError(f"GPT-2 option {option}={getattr(hf_cfg, option)!r} is not supported (only {supported})")
    if hf_cfg.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise UserError(f"activation_function={hf_cfg.activation_function!r} not supported; allowed: gelu_new")
    cfg = GPTConfig(
        d_vocab=hf_cfg.vocab_size,
        n_ctx=hf_cfg.n_positions,
        d_model=hf_cfg.n_embd,
        n_heads=hf_cfg.n_head,
        n_layers=hf_cfg.n_layer,
        d_mlp=hf_cfg.n_inner or 4 * hf_cfg.n_embd,
        ln_eps=hf_cfg.layer_norm_epsilon,
        model_name=getattr(hf_cfg, "name_or_path", "") or "gpt2",
    )
    if tokenizer is not None and not isinstance(tokenizer, HFTokenizer):
        tokenizer = HFTokenizer(tokenizer)
    model = GPTModel(cfg, tokenizer)
    model.load_state_dict(_convert_state_dict(source.state_dict(), cfg))
    model.family = "gpt2"
    model.check_finite()
    return model.eval()


def _convert_state_dict(hf: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    ours = {
        "embed.weight": hf["transformer.wte.weight"],
        "pos_embed.weight": hf["transformer.wpe.weight"],
        "ln_final.weight": hf["transformer.ln_f.weight"],
        "ln_final.bias": hf["transformer.ln_f.bias"],
    }
    for layer in range(cfg.n_layers):
        src, dst = f"transformer.h.{layer}.", f"blocks.{layer}."
        q_w, k_w, v_w = hf[src + "attn.c_attn.weight"].T.chunk(3, dim=0)
        q_b, k_b, v_b = hf[src + "attn.c_attn.bias"].chunk(3, dim=0)
        for name, weight, bias in (("W_query", q_w, q_b), ("W_key", k_w, k_b), ("W_value", v_w, v_b)):
            ours[dst + f"attn.{name}.weight"] = weight
            ours[dst + f"attn.{name}.bias"] = bias
        ours[dst + "attn.out_proj.weight"] = hf[src + "attn.c_proj.weight"].T
        ours[dst + "attn.out_proj.bias"] = hf[src + "attn.c_proj.bias"]
        for ln_src, ln_dst in (("ln_1", "ln1"), ("ln_2", "ln2")):
            ours[dst + f"{ln_dst}.weight"] = hf[src + f"{ln_src}.weight"]
            ours[dst + f"{ln_dst}.bias"] = hf[src + f"{ln_src}.bias"]
        ours[dst + "mlp.fc.weight"] = hf[src + "mlp.c_fc.weight"].T
        ours[dst + "mlp.fc.bias"] = hf[src + "mlp.c_fc.bias"]
        ours[dst + "mlp.proj.weight"] = hf[src + "mlp.c_proj.weight"].T
        ours[dst + "mlp.proj.bias"] = hf[src + "mlp.c_proj.bias"]
    return {name: tensor.detach().clone().contiguous() for name, tensor in ours.items()}


def byte_level_gpt2_tokenizer():
    """A GPT-2-style byte-level BPE tokenizer with no merges: 256 byte tokens + ``<|endoftext|>``
    (id 256). Built locally, so tests and offline notebooks get a real HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _byte_alphabet().items()}
    vocab["<|endoftext|>"] = 256
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    # add_bos_token=True up front: otherwise TransformerLens's bridge reloads the tokenizer by name.
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>",
        add_bos_token=True, name_or_path="byte-level-gpt2",
    )


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves,
    the others are moved past 255 in order, so byte-level BPE never sees whitespace/control chars."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = (b for b in range(256) if b not in printable)
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(moved)}


def make_random_gpt2(n_layers=2, d_model=64, n_heads=4, n_ctx=64, d_vocab=257, seed=0):
    """``(GPT2LMHeadModel, tokenizer)``: a randomly initialised GPT-2 in eval mode with eager
    attention, and the byte-level tokenizer above. ``d_vocab`` must be >= 257."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if d_vocab < 257:
        raise UserError(f"d_vocab={d_vocab} must be >= 257 to hold the byte-level tokenizer")
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=n_layers, n_embd=d_model, n_head=n_heads, n_positions=n_ctx,
                        vocab_size=d_vocab, bos_token_id=256, eos_token_id=256)
    model = GPT2LMHeadModel(config)
    model.config._attn_implementation = "eager"
    return model.eval(), byte_level_gpt2_tokenizer()


def gpt2_bridge(model, tokenizer, name: str = "gpt2"):
    """A TransformerLens ``TransformerBridge`` over a copy of an in-memory ``GPT2LMHeadModel`` (no
    network: the config comes from the model and the tokenizer must be given). Booting rewires the
    model it is given, so it gets a copy and ``model`` stays usable, e.g. for ``from_gpt2``."""
    from transformer_lens.model_bridge import TransformerBridge

    if tokenizer is None:
        raise UserError("a TransformerBridge needs a tokenizer offline; the GPT-2 directory has none")
    return TransformerBridge.boot_transformers(name, hf_model=copy.deepcopy(model).eval(), tokenizer=tokenizer)
