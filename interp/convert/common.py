"""What the Hugging Face converters (``interp.convert.gpt2``, ``interp.convert.llama``, ``interp.convert.neox``,
``interp.convert.phi``, ``interp.convert.bloom``) share: reading a family's config into ``GPTConfig`` knobs,
refusing the options the from-scratch model does not implement (one line each, never a silent
difference), copying weights by module name, and building the model.

Two rules keep a conversion from silently differing (docs/guides/families.md lists each family's
options): a converter reads a config field only where the family's Hugging Face code reads it
(a stray ``attention_bias`` in a Mistral config changes nothing there, so nothing here), and every
tensor of the Hugging Face state dict must be read (``HFWeights``), as every one of ours must be
filled (a strict ``load_state_dict``): a weight no converter reads belongs to a part of the model
the from-scratch one does not have.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from einops import rearrange
from torch import nn

from interp.errors import UserError
from interp.hub import refuse_mismatched_tensors
from interp.model import GPTConfig, GPTModel
from interp.tokenizer import as_tokenizer

# Hugging Face activation names -> ours (``interp.model.ACTIVATIONS``)
_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "silu": "silu"}


class HFWeights(dict):
    """A Hugging Face state dict ``{name: tensor}`` that records which names were read with ``[]``
    (``in`` is not a read), so ``scratch_model`` can refuse weights a converter left out."""

    def __init__(self, state: dict[str, torch.Tensor]):
        super().__init__(state)
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        self.read.add(name)
        return super().__getitem__(name)

    def unread(self) -> list[str]:
        """The names never read, but for a tied weight: one whose storage a read tensor shares
        (a tied unembedding is the embedding under a second name)."""
        read = {_storage(dict.__getitem__(self, name)) for name in self.read}
        return [name for name, tensor in dict.items(self)
                if name not in self.read and _storage(tensor) not in read]


def _storage(tensor: torch.Tensor) -> tuple:
    """What makes two state-dict entries one tied weight: the same memory, shape and strides."""
    return tensor.data_ptr(), tuple(tensor.shape), tensor.stride()


def refuse_options(hf_cfg, family: str, supported: dict) -> None:
    """Raise when ``hf_cfg`` sets an option to anything but the one value ``supported`` names."""
    for option, value in supported.items():
        if getattr(hf_cfg, option, value) != value:
            raise UserError(f"{family} option {option}={getattr(hf_cfg, option)!r} is not implemented from scratch "
                            f"(only {value!r}); use impl='transformer_lens'")


def activation(name: str, family: str, field: str = "hidden_act") -> str:
    """Our ``act_fn`` for a Hugging Face activation name (the config's ``field``)."""
    if name not in _ACTIVATIONS:
        raise UserError(f"{family} {field}={name!r} is not implemented from scratch; allowed: "
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


def rotary(hf_cfg, family: str, d_head: int, partial: bool = False) -> dict:
    """The rotary knobs from ``rope_parameters``: the base and the rotated dims: all of a head's
    ``d_head``, or with ``partial`` (GPT-NeoX, Phi: the families whose code reads it)
    ``partial_rotary_factor`` of them; Llama's layout ignores that key, and so do we. Only the
    original RoPE is implemented: a scaled one (linear, dynamic, yarn, llama3, ...) is refused."""
    rope = hf_cfg.rope_parameters
    if rope.get("rope_type", "default") != "default":
        raise UserError(f"{family} rope_type={rope['rope_type']!r} is not implemented from scratch (only the "
                        "default RoPE); use impl='transformer_lens'")
    factor = rope.get("partial_rotary_factor", 1.0) if partial else 1.0
    return dict(positional_embedding_type="rotary", rotary_base=rope["rope_theta"], rotary_dim=int(d_head * factor))


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


def scratch_model(cfg: GPTConfig, state: dict[str, torch.Tensor], tokenizer, family: str,
                  source: HFWeights) -> GPTModel:
    """``GPTModel(cfg)`` holding exactly ``state`` (every tensor, no other: strict), in eval mode,
    with ``family`` recorded and the Hugging Face ``tokenizer`` (the byte tokenizer when None).
    ``source``: the Hugging Face weights ``state`` was made from; one the converter did not read
    is refused (a part of the model ours lacks)."""
    unread = source.unread()
    if unread:
        shown = ", ".join(unread[:3]) + (f" and {len(unread) - 3} more" if len(unread) > 3 else "")
        raise UserError(f"{family} weights {shown} have no place in the from-scratch model (it would run without "
                        "them); use impl='transformer_lens'")
    state = {name: tensor.detach().contiguous() for name, tensor in state.items()}  # a copy only where strided
    model = model_from_state(cfg, state, as_tokenizer(tokenizer) if tokenizer is not None else None, family)
    model.family = family
    return model


@contextmanager
def parameters_on_meta():
    """Inside it, every ``nn.Parameter`` a module registers is swapped for one on the meta device
    (no memory, no initialisation: ``reset_parameters`` on meta does nothing), while buffers (the
    causal mask, rotary frequencies, ALiBi slopes) are made as usual. A module's ``torch.empty``
    weight is allocated but never touched, so it never becomes resident."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def model_from_state(cfg: GPTConfig, state: dict[str, torch.Tensor], tokenizer, source: str) -> GPTModel:
    """``GPTModel(cfg, tokenizer)`` whose parameters ARE ``state``'s tensors (assigned, not copied:
    loading costs the model's own size), in eval mode. ``state`` must name every parameter and
    persistent buffer of the model and nothing else, each of its shape (else a one-line error naming
    ``source``); a non-finite weight is refused. The model takes the tensors' dtype and device."""
    with parameters_on_meta():
        model = GPTModel(cfg, tokenizer)
    expected = {name: tensor.shape for name, tensor in model.state_dict().items()}
    misshaped = [name for name in set(state) & set(expected) if state[name].shape != expected[name]]
    refuse_mismatched_tensors(source, set(expected) - set(state), set(state) - set(expected), misshaped)
    model.load_state_dict(state, strict=True, assign=True)
    model.check_finite()
    return model.eval()
