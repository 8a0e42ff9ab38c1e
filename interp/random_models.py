"""Randomly initialised Hugging Face models of each family, with a local tokenizer, for tests,
notebooks and benchmarks that must run offline (weights cannot be downloaded everywhere).

Each family's tokenizer is a byte-level BPE with no merges (256 byte tokens) whose special tokens
sit where the family's real tokenizer puts them, so code meets the same conventions it meets on
the real models: Llama's ``<s>`` at 1, Gemma's ``<bos>`` at 2, OPT starting with ``</s>``, Pythia's
``<|endoftext|>`` at 0 doing BOS and EOS, Qwen2 with no BOS at all, GPT-2 and Phi with
``<|endoftext|>`` after the bytes. The models' vocabularies are padded past the tokenizer, as real
checkpoints' often are, so the padded ids are not real tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Specials:
    """Special tokens of a family's tokenizer: ``front`` get ids 0.. before the 256 bytes, ``back``
    the ids after them; ``bos``/``eos``/``pad``/``unk`` name which is which (None: the tokenizer has none)."""

    front: tuple[str, ...] = ()
    back: tuple[str, ...] = ()
    bos: str | None = None
    eos: str | None = None
    pad: str | None = None
    unk: str | None = None


_ENDOFTEXT = "<|endoftext|>"
SPECIALS = {
    "gpt2": Specials(back=(_ENDOFTEXT,), bos=_ENDOFTEXT, eos=_ENDOFTEXT, unk=_ENDOFTEXT),
    "phi": Specials(back=(_ENDOFTEXT,), bos=_ENDOFTEXT, eos=_ENDOFTEXT, unk=_ENDOFTEXT),
    "llama": Specials(front=("<unk>", "<s>", "</s>"), bos="<s>", eos="</s>", unk="<unk>"),
    "mistral": Specials(front=("<unk>", "<s>", "</s>"), bos="<s>", eos="</s>", unk="<unk>"),
    "gemma": Specials(front=("<pad>", "<eos>", "<bos>", "<unk>"), bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>"),
    "gemma2": Specials(front=("<pad>", "<eos>", "<bos>", "<unk>"), bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>"),
    "gemma3_text": Specials(front=("<pad>", "<eos>", "<bos>", "<unk>"), bos="<bos>", eos="<eos>", pad="<pad>",
                            unk="<unk>"),
    "opt": Specials(front=("<s>", "<pad>", "</s>", "<unk>"), bos="</s>", eos="</s>", pad="<pad>", unk="<unk>"),
    "gpt_neox": Specials(front=(_ENDOFTEXT, "<|padding|>"), bos=_ENDOFTEXT, eos=_ENDOFTEXT, pad="<|padding|>",
                         unk=_ENDOFTEXT),
    "qwen2": Specials(back=(_ENDOFTEXT, "<|im_start|>", "<|im_end|>"), eos=_ENDOFTEXT, pad=_ENDOFTEXT),
    "gpt_neo": Specials(back=(_ENDOFTEXT,), bos=_ENDOFTEXT, eos=_ENDOFTEXT, unk=_ENDOFTEXT),
}
FAMILIES = tuple(SPECIALS)

# Tiny shapes: 2 layers, d_model 64, 4 query heads; each family's own features switched on.
_D, _HEADS, _MLP = 64, 4, 128
_SHAPES = {
    "gpt2": dict(n_layer=2, n_embd=_D, n_head=_HEADS),
    "llama": dict(hidden_size=_D, num_hidden_layers=2, num_attention_heads=_HEADS, num_key_value_heads=2,
                  intermediate_size=_MLP),
    "mistral": dict(hidden_size=_D, num_hidden_layers=2, num_attention_heads=_HEADS, num_key_value_heads=2,
                    intermediate_size=_MLP, sliding_window=None),
    "qwen2": dict(hidden_size=_D, num_hidden_layers=2, num_attention_heads=_HEADS, num_key_value_heads=2,
                  intermediate_size=_MLP),
    "gemma": dict(hidden_size=_D, num_hidden_layers=2, num_attention_heads=_HEADS, num_key_value_heads=1,
                  head_dim=_D // _HEADS, intermediate_size=_MLP),
    # Gemma 2: layer 0 local, layer 1 global (its every-other-layer rule); scores and logits soft-capped
    "gemma2": dict(hidden_size=_D, num_hidden_layers=2, num_attention_heads=_HEADS, num_key_value_heads=2,
                   head_dim=_D // _HEADS, intermediate_size=_MLP, query_pre_attn_scalar=_D // _HEADS),
    # Gemma 3: a global layer after each local one (its own default is five local layers, then one global)
    "gemma3_text": dict(hidden_size=_D, num_hidden_layers=2, num_attention_heads=_HEADS, num_key_value_heads=2,
                        head_dim=_D // _HEADS, intermediate_size=_MLP, query_pre_attn_scalar=_D // _HEADS,
                        sliding_window_pattern=2),
    "gpt_neox": dict(hidden_size=_D, num_hidden_layers=2, num_attention_heads=_HEADS, intermediate_size=_MLP,
                     rotary_pct=0.25, use_parallel_residual=True),
    "phi": dict(hidden_size=_D, num_hidden_layers=2, num_attention_heads=_HEADS, intermediate_size=_MLP),
    "opt": dict(hidden_size=_D, num_hidden_layers=2, num_attention_heads=_HEADS, ffn_dim=_MLP,
                word_embed_proj_dim=_D),
    "gpt_neo": dict(hidden_size=_D, num_layers=2, num_heads=_HEADS, intermediate_size=_MLP,
                    attention_types=[[["global", "local"], 1]]),
}
_CONTEXT_KEY = {"gpt2": "n_positions"}  # every other family: max_position_embeddings


def family_tokenizer(family: str):
    """A ``PreTrainedTokenizerFast`` with the special tokens of ``family`` (see ``SPECIALS``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = SPECIALS[family]
    symbols = [*specials.front, *_byte_alphabet().values(), *specials.back]
    core = Tokenizer(models.BPE(vocab={symbol: i for i, symbol in enumerate(symbols)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    named = {f"{kind}_token": getattr(specials, kind) for kind in ("bos", "eos", "pad", "unk")}
    extra = [s for s in (*specials.front, *specials.back) if s not in named.values()]
    # add_bos_token up front where there is a BOS: else TransformerLens's bridge reloads the
    # tokenizer by its name, from the hub
    return PreTrainedTokenizerFast(tokenizer_object=core, name_or_path=f"byte-level-{family}",
                                   additional_special_tokens=extra, add_bos_token=specials.bos is not None,
                                   **{k: v for k, v in named.items() if v})


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves,
    the others are moved past 255 in order, so byte-level BPE never sees whitespace/control chars."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = (b for b in range(256) if b not in printable)
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(moved)}


def random_hf_model(family: str, *, seed: int = 0, n_ctx: int = 128, d_vocab: int = 320, **shape):
    """``(causal LM in eval mode with eager attention, tokenizer)``: a randomly initialised tiny
    model of ``family`` (``FAMILIES``); ``shape`` overrides any of the family's config keys (its
    special token ids and vocabulary too)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if family not in SPECIALS:
        raise ValueError(f"unknown family {family!r}; allowed: {', '.join(FAMILIES)}")
    tokenizer = family_tokenizer(family)
    if d_vocab < len(tokenizer):
        raise ValueError(f"d_vocab={d_vocab} must be >= {len(tokenizer)} to hold the {family} tokenizer")
    ids = {f"{kind}_token_id": tokenizer.convert_tokens_to_ids(getattr(SPECIALS[family], kind))
           for kind in ("bos", "eos", "pad") if getattr(SPECIALS[family], kind)}
    size = {"vocab_size": d_vocab, _CONTEXT_KEY.get(family, "max_position_embeddings"): n_ctx}
    config = AutoConfig.for_model(family, **(size | ids | _SHAPES[family] | shape))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    # as save_pretrained records it: the bridge finds a family by it (it has no entry for gemma3_text)
    model.config.architectures = [type(model).__name__]
    return model.eval(), tokenizer


def save_random_model(family: str, directory: str | Path, **options) -> Path:
    """``random_hf_model(family, **options)`` written with ``save_pretrained`` (weights, config and
    tokenizer), as a downloaded model's directory would be."""
    model, tokenizer = random_hf_model(family, **options)
    directory = Path(directory)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def make_random_gpt2(n_layers=2, d_model=64, n_heads=4, n_ctx=64, d_vocab=257, seed=0):
    """``(GPT2LMHeadModel, tokenizer)``: a random GPT-2 of the given shape whose tokenizer is the
    256 bytes + ``<|endoftext|>`` (id 256). ``d_vocab`` must be >= 257."""
    return random_hf_model("gpt2", seed=seed, n_ctx=n_ctx, d_vocab=d_vocab, n_layer=n_layers, n_embd=d_model,
                           n_head=n_heads)


def random_like(model, seed: int = 0):
    """The architecture of ``model`` (a loaded ``GPTModel`` or ``TransformerBridge``) at random
    initialisation, with the same tokenizer, device and dtype, in eval mode: the null model of
    calibration (architecture §4.7). Deterministic in ``seed``; the global random state is restored.

    A model that came from a Hugging Face one (a bridge; a ``GPTModel`` made by ``from_hf``, which
    keeps ``hf_config``) is rebuilt by ``AutoModelForCausalLM.from_config`` with that family's own
    initialisation, so both implementations of one model get the very same random weights (the
    ``GPTModel`` converted from them, in the model's precision); our own ``GPTModel`` checkpoints are rebuilt from ``cfg``
    with GPT-2's initialisation (``gpt2_initialise``). Each call builds one model at its own size, in
    its dtype; a caller drawing several nulls holds one at a time (``analyses.roles.nulls.random_init_null``)."""
    from transformers import AutoModelForCausalLM

    from interp.bridge import boot_bridge
    from interp.convert import from_hf

    parameter = next(model.parameters())
    config = getattr(model, "original_model", None)
    config = config.config if config is not None else getattr(model, "hf_config", None)
    with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
        torch.manual_seed(seed)
        if config is None:
            fresh = gpt2_initialise(type(model)(model.cfg, model.tokenizer))
            fresh.family = model.family
            return fresh.to(device=parameter.device, dtype=parameter.dtype).eval()
        # made in the model's dtype (no float32 copy first); its tensors become the null model's own
        hf_model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=parameter.dtype)
        hf_model = hf_model.to(device=parameter.device).eval()
        if hasattr(model, "original_model"):
            return boot_bridge(hf_model, model.tokenizer, name=f"random-init-{seed}", copy=False)
        null = from_hf(hf_model, model.tokenizer, release=True).eval()
        null.set_precision(model.cfg.precision)  # a mixed-precision model's nulls run as it does
        return null


def gpt2_initialise(model):
    """GPT-2's initialisation in place (as Hugging Face's ``GPT2PreTrainedModel``): every weight
    matrix and embedding N(0, 0.02), each projection back into the residual stream (attention
    output, MLP output) N(0, 0.02 / sqrt(2 n_layers)), biases 0, norm gains 1. Returns ``model``."""
    std = 0.02
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim < 2:
                param.fill_(0.0 if name.endswith("bias") else 1.0)
            else:
                into_residual = name.endswith(("attn.out_proj.weight", "mlp.proj.weight"))
                scale = (2 * model.cfg.n_layers) ** -0.5 if into_residual else 1.0
                param.normal_(0.0, std * scale)
    return model
