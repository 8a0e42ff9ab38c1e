"""What the Hugging Face converters (``interp.gpt2``, ``interp.llama``, ``interp.neox``,
``interp.phi``, ``interp.bloom``) share: reading a family's config into ``GPTConfig`` knobs,
refusing the options the from-scratch model does not implement (one line each, never a silent
difference), copying weights by module name, and building the model.
"""

from __future__ import annotations

import torch
from einops import rearrange

from interp.errors import UserError
from interp.model import GPTConfig, GPTModel
from interp.tokenizer import as_tokenizer

# Hugging Face activation names -> ours (``interp.model.ACTIVATIONS``)
_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "silu": "silu"}


def refuse_options(hf_cfg, family: str, supported: dict) -> None:
    """Raise when ``hf_cfg`` sets an option to anything but the one value ``supported`` names."""
    for option, value in supported.items():
        if getattr(hf_cfg, option, value) != value:
            raise UserError(f"{family} option {option}={getattr(hf_cfg, option)!r} is not implemented from scratch "
                            f"(only {value!r}); use impl='transformer_lens'")


def activation(name: str, family: str) -> str:
    """Our ``act_fn`` for a Hugging Face activation name (a config's ``hidden_act``)."""
    if name not in _ACTIVATIONS:
        raise UserError(f"{family} hidden_act={name!r} is not implemented from scratch; allowed: "
                        f"{', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def shape(hf_cfg, family: str) -> dict:
    """The ``GPTConfig`` fields most families spell the same way (through transformers' attribute
    map): vocabulary, context, widths, query and key/value heads, layers, whether the unembedding
    is tied, and the model's name."""
    return dict(
        d_vocab=hf_cfg.vocab_size,
        n_ctx=hf_cfg.max_position_embeddings,
        d_model=hf_cfg.hidden_size,
        n_heads=hf_cfg.num_attention_heads,
        n_layers=hf_cfg.num_hidden_layers,
        d_mlp=hf_cfg.intermediate_size,
        d_head=getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads,
        n_key_value_heads=getattr(hf_cfg, "num_key_value_heads", None),
        tie_word_embeddings=bool(getattr(hf_cfg, "tie_word_embeddings", False)),
        model_name=getattr(hf_cfg, "name_or_path", "") or family,
    )


def rotary(hf_cfg, family: str, d_head: int) -> dict:
    """The rotary knobs from ``rope_parameters``: the base and the rotated dims (all of a head,
    or ``partial_rotary_factor`` of them). Only the original RoPE is implemented: a scaled one
    (linear, dynamic, yarn, llama3, ...) is refused."""
    rope = hf_cfg.rope_parameters
    if rope.get("rope_type", "default") != "default":
        raise UserError(f"{family} rope_type={rope['rope_type']!r} is not implemented from scratch (only the "
                        "default RoPE); use impl='transformer_lens'")
    return dict(positional_embedding_type="rotary", rotary_base=rope["rope_theta"],
                rotary_dim=int(d_head * rope.get("partial_rotary_factor", 1.0)))


def copy_params(hf: dict[str, torch.Tensor], names: dict[str, str]) -> dict[str, torch.Tensor]:
    """``{our module: its Hugging Face module}`` -> our state-dict entries: each module's
    ``weight`` and, where the Hugging Face module has one, its ``bias``."""
    ours = {}
    for ours_name, hf_name in names.items():
        ours[f"{ours_name}.weight"] = hf[f"{hf_name}.weight"]
        if f"{hf_name}.bias" in hf:
            ours[f"{ours_name}.bias"] = hf[f"{hf_name}.bias"]
    return ours


def module_names(cfg: GPTConfig, embed: str, final_norm: str, layers: str,
                 layer_names: dict[str, str]) -> dict[str, str]:
    """``{our module: its Hugging Face module}`` for a whole model: the token embedding, each block's
    modules (``blocks.{l}.{ours}`` <- ``{layers}{l}.{theirs}`` for ``layer_names``' pairs), the final
    norm and, where the unembedding is not tied, ``lm_head``."""
    names = {"embed": embed, "ln_final": final_norm}
    names |= {f"blocks.{layer}.{ours}": f"{layers}{layer}.{theirs}"
              for layer in range(cfg.n_layers) for ours, theirs in layer_names.items()}
    if not cfg.tie_word_embeddings:
        names["lm_head"] = "lm_head"
    return names


def unpack_qkv(hf: dict[str, torch.Tensor], cfg: GPTConfig, packed: str) -> dict[str, torch.Tensor]:
    """Every layer's query/key/value projection packed per head, as GPT-NeoX and BLOOM pack it (the
    output axis is (head, [query, key, value], d_head); ``packed`` names the module, with
    ``{layer}``) -> our ``blocks.{layer}.attn.W_query`` / ``W_key`` / ``W_value`` weights and biases."""
    split = {}
    for layer in range(cfg.n_layers):
        for kind in ("weight", "bias"):
            name = f"{packed.format(layer=layer)}.{kind}"
            if name in hf:
                parts = rearrange(hf[name], "(h three d) ... -> three (h d) ...", h=cfg.n_heads, three=3)
                split |= {f"blocks.{layer}.attn.{ours}.{kind}": part
                          for ours, part in zip(("W_query", "W_key", "W_value"), parts)}
    return split


def scratch_model(cfg: GPTConfig, state: dict[str, torch.Tensor], tokenizer, family: str) -> GPTModel:
    """``GPTModel(cfg)`` holding exactly ``state`` (every tensor, no other: strict), in eval mode,
    with ``family`` recorded and the Hugging Face ``tokenizer`` (the byte tokenizer when None)."""
    model = GPTModel(cfg, as_tokenizer(tokenizer) if tokenizer is not None else None)
    model.load_state_dict({name: tensor.detach().clone().contiguous() for name, tensor in state.items()})
    model.family = family
    model.check_finite()
    return model.eval()
