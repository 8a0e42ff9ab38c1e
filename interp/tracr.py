"""Tracr-compiled transformers as hooked ``GPTModel``s: models whose every head and MLP does one
known thing (DeepMind's Tracr compiles a RASP program into weights; ``pip install interp[tracr]``).

``from_tracr(assembled)`` copies a compiled model's weights into a from-scratch ``GPTModel`` with
the knobs Tracr's architecture needs: no normalisation, ReLU MLPs, Tracr's attention scale
``1 / sqrt(key_size)``, non-causal attention unless the program was compiled with
``causal=True``, and an untied unembedding onto the program's own output space
(``d_vocab_out``): one logit per output value for a categorical program (Tracr takes their
argmax), one column holding the value for a numerical one. Tracr's token embedding carries its
"one" direction; its position embedding has a zero row for the start token's position 0. Every
Tracr layer is an attention layer then an MLP, so Tracr's ``layer_outputs[2l]`` /
``[2l + 1]`` are ``blocks.{l}.hook_attn_out`` / ``hook_mlp_out`` and its ``residuals[2l]`` /
``[2l + 1]`` are ``hook_resid_mid`` / ``hook_resid_post``.

The model's tokenizer is a ``VocabTokenizer`` over Tracr's input encoding (the start token
"compiler_bos" -- or the one passed to the compiler -- is ``bos_token_id``, the padding token a
special id), which also names the output space (``decode_outputs``).

``PROGRAMS`` names the programs of ``tracr.compiler.lib`` with the arguments this module gives
them; ``compile_program`` compiles one.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from interp.errors import UserError
from interp.model import GPTConfig, GPTModel
from interp.tokenizer import VocabTokenizer

DEFINED = 0.5  # a categorical output logit at least this large is a written output (Tracr writes 1)
BOS = "BOS"  # the start token's name in the programs compiled here (Tracr's default is "compiler_bos")


def require_tracr() -> None:
    """Refuse, in one line, when Tracr (and jax, haiku) are not installed."""
    missing = [name for name in ("tracr", "jax", "haiku") if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"Tracr models need {', '.join(missing)}: pip install 'interp[tracr]'")


@dataclass(frozen=True)
class Program:
    """A program of ``tracr.compiler.lib``: ``build(lib, rasp, vocab, max_seq_len)`` -> the RASP
    program; ``needs`` says what the vocabulary must hold, ``fits(vocab)`` checks it."""

    build: Callable
    needs: str = ""
    fits: Callable = lambda vocab: True


def _numbers(vocab) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vocab)


def _has(*tokens: str) -> Callable:
    return lambda vocab: set(tokens) <= set(vocab)


# Where a program takes a token, it is the vocabulary's smallest (``sorted(vocab)[0]``); detect_pattern
# looks for its two smallest in order.
PROGRAMS: dict[str, Program] = {
    "length": Program(lambda lib, rasp, vocab, n: lib.make_length()),
    "reverse": Program(lambda lib, rasp, vocab, n: lib.make_reverse(rasp.tokens)),
    "hist": Program(lambda lib, rasp, vocab, n: lib.make_hist()),
    "sort_unique": Program(lambda lib, rasp, vocab, n: lib.make_sort_unique(rasp.tokens, rasp.tokens)),
    "sort": Program(lambda lib, rasp, vocab, n: lib.make_sort(rasp.tokens, rasp.tokens, max_seq_len=n,
                                                             min_key=min(vocab)),
                    "numbers (its keys are numerical)", _numbers),
    "sort_freq": Program(lambda lib, rasp, vocab, n: lib.make_sort_freq(n)),
    "frac_prevs": Program(lambda lib, rasp, vocab, n: lib.make_frac_prevs(rasp.tokens == sorted(vocab)[0])),
    "pair_balance": Program(lambda lib, rasp, vocab, n: lib.make_pair_balance(rasp.tokens, "(", ")"),
                            "'(' and ')'", _has("(", ")")),
    "shuffle_dyck": Program(lambda lib, rasp, vocab, n: lib.make_shuffle_dyck(["()"]), "'(' and ')'", _has("(", ")")),
    "shuffle_dyck2": Program(lambda lib, rasp, vocab, n: lib.make_shuffle_dyck2(), "'(', ')', '{' and '}'",
                             _has("(", ")", "{", "}")),
    "shift_by": Program(lambda lib, rasp, vocab, n: lib.shift_by(1, rasp.tokens)),
    "detect_pattern": Program(lambda lib, rasp, vocab, n: lib.detect_pattern(rasp.tokens, sorted(vocab)[:2]),
                              "two tokens or more", lambda vocab: len(vocab) >= 2),
    "count_less_freq": Program(lambda lib, rasp, vocab, n: lib.make_count_less_freq(2)),
    "count": Program(lambda lib, rasp, vocab, n: lib.make_count(rasp.tokens, sorted(vocab)[0])),
}


def library_program(name: str, vocab: Sequence, max_seq_len: int):
    """The RASP program ``name`` of ``PROGRAMS`` for this vocabulary and length."""
    require_tracr()
    from tracr.compiler import lib
    from tracr.rasp import rasp
    if name not in PROGRAMS:
        raise UserError(f"unknown Tracr program {name!r}; allowed: {', '.join(PROGRAMS)}")
    vocab = list(vocab)
    if not vocab or len(set(vocab)) != len(vocab):
        raise UserError(f"vocab {vocab} must be a non-empty list of distinct tokens")
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len <= 0:
        raise UserError(f"max_seq_len={max_seq_len!r} must be a positive integer")
    program = PROGRAMS[name]
    if not program.fits(vocab):
        raise UserError(f"program {name!r} needs a vocabulary of {program.needs}; got {vocab}")
    return program.build(lib, rasp, vocab, max_seq_len)


def compile_program(name: str, vocab: Sequence, max_seq_len: int, causal: bool = False):
    """Compile ``PROGRAMS[name]`` with Tracr -> its ``AssembledTransformerModel`` (start token ``BOS``)."""
    from tracr.compiler import compiling
    program = library_program(name, vocab, max_seq_len)
    return compiling.compile_rasp_to_model(program, set(vocab), max_seq_len, causal=causal, compiler_bos=BOS)


def _unembedding(assembled) -> np.ndarray:
    """Tracr's own unembedding module applied to the identity -> (d_model, n_outputs): the
    projection of the residual onto the output space."""
    import haiku as hk
    import jax.numpy as jnp

    @hk.without_apply_rng
    @hk.transform
    def unembed(x):
        return assembled.get_compiled_model().unembed(x, use_unembed_argmax=False)

    d_model = len(assembled.residual_labels)
    matrix = np.asarray(unembed.apply(assembled.params, jnp.eye(d_model, dtype=jnp.float32)))
    return matrix.reshape(d_model, -1)


def from_tracr(assembled) -> GPTModel:
    """A Tracr ``AssembledTransformerModel`` -> an equal ``GPTModel`` (see the module docstring)."""
    require_tracr()
    import jax
    config = assembled.model_config
    if config.layer_norm or config.activation_function is not jax.nn.relu:
        raise UserError("only Tracr's compiled models (no layer norm, ReLU MLPs) can be converted; this one has "
                        f"layer_norm={config.layer_norm}, activation {config.activation_function}")
    if assembled.input_encoder is None or assembled.input_encoder.bos_token is None:
        raise UserError("the Tracr model has no categorical input encoder with a start token (compile it with "
                        "tracr.compiler.compiling.compile_rasp_to_model)")
    params = {name: {key: np.asarray(value, dtype=np.float32) for key, value in group.items()}
              for name, group in assembled.params.items()}
    unembedding = _unembedding(assembled)
    token_embed, pos_embed = params["token_embed"]["embeddings"], params["pos_embed"]["embeddings"]
    cfg = GPTConfig(
        d_vocab=token_embed.shape[0], n_ctx=pos_embed.shape[0], d_model=token_embed.shape[1],
        n_heads=config.num_heads, n_layers=config.num_layers, d_head=config.key_size, d_mlp=config.mlp_hidden_size,
        normalization_type=None, act_fn="relu", causal=bool(config.causal), tie_word_embeddings=False,
        d_vocab_out=unembedding.shape[1], model_name="tracr",
    )
    model = GPTModel(cfg, _tokenizer(assembled))
    state = {"embed.weight": token_embed, "pos_embed.weight": pos_embed, "lm_head.weight": unembedding.T}
    for layer in range(cfg.n_layers):
        attn, mlp = f"transformer/layer_{layer}/attn", f"transformer/layer_{layer}/mlp"
        pairs = {"attn.W_query": f"{attn}/query", "attn.W_key": f"{attn}/key", "attn.W_value": f"{attn}/value",
                 "attn.out_proj": f"{attn}/linear", "mlp.fc": f"{mlp}/linear_1", "mlp.proj": f"{mlp}/linear_2"}
        for ours, theirs in pairs.items():  # haiku's Linear is x @ w + b; torch's x @ weight.T + bias
            state[f"blocks.{layer}.{ours}.weight"] = params[theirs]["w"].T
            state[f"blocks.{layer}.{ours}.bias"] = params[theirs]["b"]
    model.load_state_dict({name: torch.tensor(np.ascontiguousarray(value)) for name, value in state.items()})
    return model.eval()


def _tokenizer(assembled) -> VocabTokenizer:
    """Tracr's input encoding (ids in its order) and, for a categorical program, its output values."""
    encoder = assembled.input_encoder
    tokens = sorted(encoder.encoding_map, key=encoder.encoding_map.get)
    outputs = None
    if hasattr(assembled.output_encoder, "encoding_map"):
        outputs = sorted(assembled.output_encoder.encoding_map, key=assembled.output_encoder.encoding_map.get)
    return VocabTokenizer([_plain(t) for t in tokens], encoder.bos_encoding, [encoder.pad_encoding],
                          None if outputs is None else [_plain(v) for v in outputs])


def _plain(value):
    """A numpy scalar as the Python value (for JSON); other values as they are."""
    return value.item() if isinstance(value, np.generic) else value


def decode_outputs(model: GPTModel, logits: torch.Tensor) -> list[list]:
    """Logits (batch, pos, d_vocab_out) of a converted Tracr model -> per row, per position the
    program's output: the float of the single column (numerical), or (categorical) the value of
    the largest logit (ties go to the first, as Tracr's ``argmax``), None where no logit reaches
    ``DEFINED`` -- Tracr writes a one-hot output, so there the program wrote nothing (RASP's
    None, e.g. the start token's position 0, or ``detect_pattern`` before a whole pattern fits),
    where Tracr's own argmax picks among rounding noise."""
    outputs = getattr(model.tokenizer, "outputs", None)
    if outputs is None:
        if logits.shape[-1] != 1:
            raise UserError(f"logits of width {logits.shape[-1]} with no output vocabulary: not a Tracr model's")
        return logits[..., 0].tolist()
    best, index = logits.max(-1)
    return [[outputs[i] if value >= DEFINED else None for i, value in zip(row, values)]
            for row, values in zip(index.tolist(), best.tolist())]


def encode_inputs(model: GPTModel, inputs: Sequence[Sequence]) -> torch.Tensor:
    """Programs' inputs (lists of vocabulary values, all of one length, without the start token)
    -> token ids (batch, 1 + length), the start token first."""
    tokens = model.tokenizer.tokens
    ids = {token: i for i, token in enumerate(tokens)}
    rows = [list(row) for row in inputs]
    if not rows or len({len(row) for row in rows}) != 1:
        raise UserError("inputs must be a non-empty list of sequences of one length")
    unknown = sorted({str(v) for row in rows for v in row if v not in ids})
    if unknown:
        raise UserError(f"inputs hold {unknown}, outside the vocabulary {tokens}")
    return torch.tensor([[model.tokenizer.bos_token_id] + [ids[v] for v in row] for row in rows])
