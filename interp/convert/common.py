"""The one conversion every Hugging Face family goes through (architecture §3.4): a ``Family`` is a row
of the table in ``interp.convert.families`` (where the family's weights are and how its config
reads into ``GPTConfig`` knobs); ``convert`` reads any row. Beside it, what the rows share:
reading activation names and RoPE settings, refusing the options the from-scratch model does not
implement (one line each, never a silent difference), and building the model on meta.

Two rules keep a conversion from silently differing (docs/guides/families.md lists each family's
options): a family reads a config field only where its Hugging Face code reads it (a stray
``attention_bias`` in a Mistral config changes nothing there, so nothing here), and every tensor of
the Hugging Face state dict must be read (``HFWeights``), as every one of ours must be filled (a
strict ``load_state_dict``): a weight no row reads belongs to a part of the model the from-scratch
one does not have.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from einops import rearrange
from torch import nn

from interp.attention import rotary_frequencies
from interp.convert.gguf import ROPE_DIVISORS
from interp.errors import UserError
from interp.hub import refuse_mismatched_tensors
from interp.model import GPTConfig, GPTModel
from interp.tokenizer import as_tokenizer, follow_tokenizer, tokenizer_adds_bos

# the rope_types implemented (transformers' names)
_ROPE_TYPES = ("default", "llama3")
# Hugging Face activation names -> ours (``interp.model.ACTIVATIONS``)
_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "silu": "silu"}


class HFWeights(dict):
    """A Hugging Face state dict ``{name: tensor}`` that records which names were read with ``[]``
    (``in`` is not a read), so ``scratch_model`` can refuse weights the table left out."""

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


def activation(hf_cfg, key: str = "hidden_act") -> str:
    """Our ``act_fn`` for the Hugging Face activation the config names under ``key``."""
    name = getattr(hf_cfg, key)
    if name not in _ACTIVATIONS:
        raise UserError(f"{hf_cfg.model_type} {key}={name!r} is not implemented from scratch; allowed: "
                        f"{', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def shape(hf_cfg) -> dict:
    """The ``GPTConfig`` fields most families spell the same way (through transformers' attribute
    map): vocabulary, context, widths, query and key/value heads, layers, and whether the
    unembedding is tied."""
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
    )


def rotary(hf_cfg, d_head: int, partial: bool = False) -> dict:
    """The rotary knobs from ``rope_parameters``: the base and the rotated dims: all of a head's
    ``d_head``, or with ``partial`` (GPT-NeoX, Phi: the families whose code reads it)
    ``partial_rotary_factor`` of them; Llama's layout ignores that key, and so do we. The original
    RoPE and Llama 3's (``llama3``: each frequency divided by its ``llama3_divisors``) are
    implemented; another scaled one (linear, dynamic, yarn, ...) is refused."""
    rope = hf_cfg.rope_parameters
    kind = rope.get("rope_type", "default")
    if kind not in _ROPE_TYPES:
        raise UserError(f"{hf_cfg.model_type} rope_type={kind!r} is not implemented from scratch (only "
                        f"{', '.join(_ROPE_TYPES)}); use impl='transformer_lens'")
    factor = rope.get("partial_rotary_factor", 1.0) if partial else 1.0
    knobs = dict(positional_embedding_type="rotary", rotary_base=rope["rope_theta"], rotary_dim=int(d_head * factor))
    if kind == "llama3":
        knobs["rotary_divisors"] = llama3_divisors(rope, rotary_frequencies(knobs["rotary_dim"], rope["rope_theta"]))
    return knobs


def llama3_divisors(rope: Mapping, frequencies: torch.Tensor) -> tuple[float, ...]:
    """Llama 3's scaled RoPE as one divisor per frequency (``frequencies``: (rotary_dim // 2,), the
    unscaled ones), rounded to float32, from ``rope`` (``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``): 1 for a wavelength under the
    original context / ``high_freq_factor``, ``factor`` over the original context /
    ``low_freq_factor``, and between them the reciprocal of a blend, ``1 / ((1 - s) / factor + s)``
    with ``s = (context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)``
    (Meta's reference code; transformers' ``_compute_llama3_parameters``; the ``rope_freqs``
    tensor llama.cpp's converter writes)."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    context = rope["original_max_position_embeddings"]
    divisors = []
    for wavelength in (2 * math.pi / frequencies.double()).tolist():
        if wavelength < context / high:
            divisors.append(1.0)
        elif wavelength > context / low:
            divisors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return tuple(torch.tensor(divisors, dtype=torch.float32).tolist())


@dataclass(frozen=True)
class Family:
    """One Hugging Face ``model_type`` as the from-scratch model reads it: a row of
    ``interp.convert.CONVERTERS``. Module names are Hugging Face's, without ``.weight``.

    Attributes:
        config: the Hugging Face config -> ``GPTConfig`` fields (the family's knobs; it refuses, in
            one line, a value it cannot honour).
        embed, final_norm: the token embedding and the final norm.
        layers: the prefix of layer ``l``'s modules, ``f"{layers}{l}."``.
        layer_names: ``{our module in a block: theirs in a layer}`` (``"attn.out_proj": "self_attn.o_proj"``).
        top_names: ``{our module: theirs}`` for the other top-level modules (learned positions, a
            norm on the embeddings).
        refused: ``{config option: the only value implemented}``.
        packed_qkv: the layer module that packs query, key and value on its output axis, or None.
        qkv_layout: how that axis is packed, as einops axes: ``"h three d"`` (per head, GPT-NeoX,
            BLOOM) or ``"three h d"`` (side by side, GPT-2).
        conv1d: the layer modules' weights are stored (in, out) (GPT-2's ``Conv1D``): transposed
            into ``nn.Linear``'s (out, in).
        norm_offset: added to every norm weight (Gemma's RMSNorm multiplies by ``1 + weight``), the
            query and key norms' too.
    """

    config: Callable[[object], dict]
    embed: str
    final_norm: str
    layers: str
    layer_names: Mapping[str, str]
    top_names: Mapping[str, str] = field(default_factory=dict)
    refused: Mapping[str, object] = field(default_factory=dict)
    packed_qkv: str | None = None
    qkv_layout: str = "h three d"
    conv1d: bool = False
    norm_offset: float = 0.0

    def module_names(self, cfg: GPTConfig) -> dict[str, str]:
        """``{our module: its Hugging Face module}`` for a whole model: the token embedding, the
        other top-level modules, each block's modules, the final norm and, where the unembedding
        is not tied, ``lm_head``."""
        names = {"embed": self.embed, **self.top_names, "ln_final": self.final_norm}
        names |= {f"blocks.{layer}.{ours}": f"{self.layers}{layer}.{theirs}"
                  for layer in range(cfg.n_layers) for ours, theirs in self.layer_names.items()}
        if not cfg.tie_word_embeddings:
            names["lm_head"] = "lm_head"
        return names

    def state(self, hf: "HFWeights", cfg: GPTConfig) -> dict[str, torch.Tensor]:
        """Our state dict from the Hugging Face weights ``hf``: each module's ``weight`` and, where
        the Hugging Face module has one, its ``bias``; the packed projections split; the norm
        offset added. Each tensor is made contiguous as it is read (a copy only where it is
        transposed or split), so a source tensor read from a file is freed before the next."""
        ours = {}
        for our_name, hf_name in self.module_names(cfg).items():
            transposed = self.conv1d and our_name.startswith("blocks.")  # a layer module's (in, out) weight
            for kind in ("weight", "bias"):
                if kind == "weight" or f"{hf_name}.{kind}" in hf:
                    tensor = hf[f"{hf_name}.{kind}"]
                    ours[f"{our_name}.{kind}"] = (tensor.t() if transposed else tensor).contiguous()
        if self.packed_qkv is not None:
            ours |= self._unpack_qkv(hf, cfg)
        if self.norm_offset:  # our norms: ln1, ln2, ln_final (and ln1_post, ln2_post), attn.q_norm, attn.k_norm
            for name in [n for n in ours if n.split(".")[-2].startswith("ln") or n.split(".")[-2].endswith("_norm")
                         if n.endswith(".weight")]:
                ours[name] = ours[name] + self.norm_offset
        return ours

    def _unpack_qkv(self, hf: "HFWeights", cfg: GPTConfig) -> dict[str, torch.Tensor]:
        """Every layer's packed query/key/value projection (its output axis laid out as
        ``qkv_layout``) -> our ``blocks.{layer}.attn.W_query`` / ``W_key`` / ``W_value`` weights and biases."""
        split = {}
        for layer in range(cfg.n_layers):
            for kind in ("weight", "bias"):
                name = f"{self.layers}{layer}.{self.packed_qkv}.{kind}"
                if name in hf:
                    packed = hf[name].t() if self.conv1d else hf[name]
                    parts = rearrange(packed, f"({self.qkv_layout}) ... -> three (h d) ...", h=cfg.n_heads, three=3)
                    split |= {f"blocks.{layer}.attn.{ours}.{kind}": part.contiguous()
                              for ours, part in zip(("W_query", "W_key", "W_value"), parts)}
        return split


def convert(family: Family, hf_cfg, hf, tokenizer=None) -> GPTModel:
    """A ``GPTModel`` of ``family`` (a row of the table) from its Hugging Face config ``hf_cfg`` and
    weights ``hf``: an ``HFWeights`` (a state dict in memory), or an
    ``interp.convert.stream.FileWeights`` (a directory, read tensor by tensor);
    ``tokenizer``: the HF tokenizer (the byte tokenizer when None). A GGUF file's ``rope_freqs``
    divisors (on ``hf_cfg`` as ``gguf_rope_divisors``: ``GGUFFile.hf_config``) become
    ``rotary_divisors``. The start token follows the tokenizer's ``add_bos_token`` where it says,
    else the row's ``default_prepend_bos`` (``interp.tokenizer.follow_tokenizer``). Refused in one
    line: an option ``family.refused`` names, a config value its ``config`` cannot honour, a weight
    the table does not read."""
    name = hf_cfg.model_type
    refuse_options(hf_cfg, name, family.refused)
    knobs = family.config(hf_cfg)
    if getattr(hf_cfg, ROPE_DIVISORS, None) is not None:  # a GGUF file's rope_freqs (GGUFFile.hf_config)
        knobs["rotary_divisors"] = getattr(hf_cfg, ROPE_DIVISORS)
    cfg = GPTConfig(**{"model_name": getattr(hf_cfg, "name_or_path", "") or name, **knobs})
    model = scratch_model(cfg, family.state(hf, cfg), tokenizer, name, hf)
    follow_tokenizer(model, tokenizer_adds_bos(tokenizer))  # the tokenizer's add_bos_token, else the row's default
    return model


def scratch_model(cfg: GPTConfig, state: dict[str, torch.Tensor], tokenizer, family: str,
                  source) -> GPTModel:
    """``GPTModel(cfg)`` holding exactly ``state`` (every tensor, no other: strict), in eval mode,
    with ``family`` recorded and the Hugging Face ``tokenizer`` (the byte tokenizer when None).
    ``source``: the Hugging Face weights ``state`` was made from (``HFWeights`` or
    ``FileWeights``); one the table did not read is refused (a part of the model ours lacks)."""
    unread = source.unread()
    if unread:
        shown = ", ".join(unread[:3]) + (f" and {len(unread) - 3} more" if len(unread) > 3 else "")
        raise UserError(f"{family} weights {shown} have no place in the from-scratch model (it would run without "
                        "them); use impl='transformer_lens'")
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
