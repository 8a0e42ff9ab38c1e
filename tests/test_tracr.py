"""Tracr-compiled programs as GPTModels (issue 25): every program of ``tracr.compiler.lib`` that
compiles, converted, against Tracr's own forward on every input up to the program's length."""

from __future__ import annotations

import itertools
from functools import lru_cache

import numpy as np
import pytest
import torch

pytest.importorskip("tracr", reason="needs the [tracr] extra")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from interp import UserError  # noqa: E402
from interp import from_tracr  # noqa: E402
from interp.tracr import PROGRAMS, compile_program, decode_outputs, encode_inputs  # noqa: E402

MAX_SEQ_LEN = 4
VOCABS = {"sort": (1, 2, 3), "pair_balance": ("(", ")"), "shuffle_dyck": ("(", ")"), "shuffle_dyck2": tuple("(){}")}


def vocab_of(name: str) -> tuple:
    return VOCABS.get(name, ("a", "b", "c"))


@lru_cache(maxsize=None)
def compiled(name: str, causal: bool = False):
    """(Tracr's assembled model, the converted GPTModel), compiled once per session."""
    assembled = compile_program(name, vocab_of(name), MAX_SEQ_LEN, causal=causal)
    return assembled, from_tracr(assembled)


def all_inputs(vocab, length: int) -> list[list]:
    return [list(row) for row in itertools.product(vocab, repeat=length)]


def tracr_run(assembled, inputs: list[list]):
    """Tracr's own forward on a batch of inputs of one length (the start token prepended by its
    own input encoder) -> (its model output, its decoded outputs per row)."""
    ids = jnp.array([assembled.input_encoder.encode([assembled.input_encoder.bos_token] + row) for row in inputs])
    output = jax.jit(assembled.forward)(assembled.params, ids)  # one XLA compilation per length, not per op
    decoded = [assembled.output_encoder.decode(row) for row in np.asarray(output.unembedded_output).tolist()]
    return output, decoded


# every program bidirectional (Tracr's default), and causally compiled the programs whose output
# needs no later token
CASES = [(name, False) for name in sorted(PROGRAMS)] + [(name, True) for name in ("count", "frac_prevs", "shift_by")]


@pytest.mark.parametrize(("name", "causal"), CASES, ids=[f"{n}-{'causal' if c else 'bidirectional'}" for n, c in CASES])
def test_converted_model_equals_tracr_on_every_input(name, causal):
    assembled, model = compiled(name, causal)
    assert model.cfg.causal == causal
    n_written = 0
    for length in range(1, MAX_SEQ_LEN + 1):
        inputs = all_inputs(vocab_of(name), length)
        theirs, their_decoded = tracr_run(assembled, inputs)
        with torch.no_grad():
            logits, cache = model.run_with_cache(encode_inputs(model, inputs))
        np.testing.assert_allclose(cache["blocks.0.hook_resid_pre"].numpy(), np.asarray(theirs.transformer_output.input_embeddings), atol=1e-5)
        for layer in range(model.cfg.n_layers):
            for i, (write, resid) in enumerate([("hook_attn_out", "hook_resid_mid"), ("hook_mlp_out", "hook_resid_post")]):
                tracr_index = 2 * layer + i
                np.testing.assert_allclose(cache[f"blocks.{layer}.{write}"].numpy(),
                                           np.asarray(theirs.transformer_output.layer_outputs[tracr_index]), atol=1e-5,
                                           err_msg=f"{name} layer {layer} {write}")
                np.testing.assert_allclose(cache[f"blocks.{layer}.{resid}"].numpy(),
                                           np.asarray(theirs.transformer_output.residuals[tracr_index]), atol=1e-5,
                                           err_msg=f"{name} layer {layer} {resid}")
        # position 0 is the start token's, whose output Tracr leaves undefined (its apply shows the
        # start token there)
        ours = [row[1:] for row in decode_outputs(model, logits)]
        their_decoded = [row[1:] for row in their_decoded]
        if model.tokenizer.outputs is None:  # numerical: the value itself
            np.testing.assert_allclose(np.array(ours), np.array(their_decoded, dtype=np.float32), atol=1e-5)
        else:  # where the program wrote an output; None (nothing written) is checked against RASP below
            written = [(o, t) for row, their_row in zip(ours, their_decoded) for o, t in zip(row, their_row) if o is not None]
            n_written += len(written)
            assert [o for o, _ in written] == [t for _, t in written], f"{name}: decoded outputs differ at length {length}"
    assert model.tokenizer.outputs is None or n_written >= len(inputs), f"{name}: fewer than one written output per input"


def test_decoded_outputs_equal_the_programs_own_evaluation():
    """The compiled model computes the RASP program: its decoded outputs equal RASP's evaluator
    (a peer of both Tracr's weights and ours) on every input of hist and sort."""
    from tracr.rasp import rasp
    from interp.tracr import library_program
    for name in ("hist", "sort", "reverse", "detect_pattern"):
        _, model = compiled(name)
        program = library_program(name, vocab_of(name), MAX_SEQ_LEN)
        inputs = all_inputs(vocab_of(name), 3)
        with torch.no_grad():
            ours = decode_outputs(model, model(encode_inputs(model, inputs)))
        assert [row[1:] for row in ours] == [rasp.evaluate(program, row) for row in inputs], name


def test_the_configuration_tracr_needs():
    _, model = compiled("frac_prevs")
    assert model.cfg.normalization_type is None and model.cfg.act_fn == "relu"
    assert model.cfg.d_vocab_out == 1 and model.tokenizer.outputs is None  # numerical: one column, the value
    _, model = compiled("hist")
    assert model.tokenizer.outputs == [0, 1, 2, 3, 4]  # counts 0..max_seq_len
    assert model.tokenizer.tokens[model.tokenizer.bos_token_id] == "BOS"
    assert model.to_tokens("abc").tolist() == model.to_tokens("a b c").tolist() == [[0, 1, 2, 3]]


def test_non_causal_attention_sees_later_tokens():
    """reverse needs the last token at position 1: bidirectional attention (no causal mask)."""
    _, model = compiled("reverse")
    with torch.no_grad():
        out = decode_outputs(model, model(encode_inputs(model, [["a", "b", "c"]])))
    assert out[0][1:] == ["c", "b", "a"]


def test_bad_input_is_refused_in_one_line():
    _, model = compiled("hist")
    with pytest.raises(UserError, match="outside the vocabulary"):
        encode_inputs(model, [["a", "z"]])
    with pytest.raises(UserError, match="outside the vocabulary"):
        model.to_tokens("az")
    with pytest.raises(UserError, match="unknown Tracr program"):
        compile_program("sorting", ["a"], 3)
    with pytest.raises(UserError, match="needs a vocabulary of numbers"):
        compile_program("sort", ["a", "b"], 3)
    with pytest.raises(UserError, match="next-token loss"):
        compiled("frac_prevs")[1](model.to_tokens("ab"), return_type="loss")


def test_checkpoint_round_trip(tmp_path):
    from interp import load_model
    from interp.loading import save_checkpoint
    _, model = compiled("sort")
    save_checkpoint(model, tmp_path)
    loaded = load_model(tmp_path)
    tokens = encode_inputs(model, [[3, 1, 2], [2, 2, 1]])
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))
    assert loaded.cfg == model.cfg and loaded.tokenizer.to_dict() == model.tokenizer.to_dict()
    assert decode_outputs(loaded, loaded(tokens))[0][1:] == [1, 2, 3]


def test_tracr_command_writes_a_checkpoint_every_command_loads(tmp_path):
    from analyses.cli import main
    from interp import load_model
    assert main(["tracr", "shift_by", "--vocab", "a,b,c", "--max-seq-len", str(MAX_SEQ_LEN), "--causal",
                 "--out", str(tmp_path)]) == 0
    loaded = load_model(tmp_path)
    _, model = compiled("shift_by", True)
    tokens = encode_inputs(model, all_inputs(vocab_of("shift_by"), MAX_SEQ_LEN))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))
    assert main(["tracr", "sort", "--vocab", "a,b", "--out", str(tmp_path / "bad")]) == 2  # one line, no traceback


def test_analyses_that_assume_causal_attention_refuse_a_bidirectional_model():
    from analyses.roles.classify import classify_heads
    _, model = compiled("hist")
    with pytest.raises(UserError, match="head classification assumes causal attention"):
        classify_heads(model, n_prompts=4, seq_len=model.cfg.n_ctx)
    with pytest.raises(UserError, match="generation assumes causal attention"):
        model.generate(model.to_tokens("ab"), max_new_tokens=1)


def test_head_roles_of_compiled_heads():
    """shift_by(1, tokens) compiles to a previous-token head, and classification names exactly
    that. hist's Select(tokens, tokens, EQ) head splits its attention evenly over the start token
    (Tracr's default), itself and earlier copies of its token: on probes with one earlier copy
    each gets 1/3, so it is named self and bos (their share is >= 0.4 once the copy is absent),
    and duplicate-token (1/3, under the 0.4 threshold) is not -- nothing it does not do."""
    from analyses.roles.classify import assign_roles, classify_heads
    vocab = list("abcdefgh")
    shift = from_tracr(compile_program("shift_by", vocab, 12, causal=True))
    roles = assign_roles(classify_heads(shift, n_prompts=16, seq_len=12))
    assert roles.role.tolist() == ["previous_token"]
    hist = from_tracr(compile_program("hist", vocab, 12, causal=True))
    scores = classify_heads(hist, n_prompts=16, seq_len=12).set_index("measure").score
    assert scores["duplicate_token"] == pytest.approx(1 / 3, abs=1e-4)
    assert set(assign_roles(classify_heads(hist, n_prompts=16, seq_len=12)).role.iloc[0].split(";")) == {"self", "bos"}


def test_the_loss_metric_refuses_an_output_space_narrower_than_the_vocabulary():
    from analyses.core.metrics import loss_metric
    _, model = compiled("shift_by")  # ids BOS, a, b, c, pad in; outputs a, b, c
    tokens = encode_inputs(model, [["c", "a"]])  # c is id 3
    with pytest.raises(UserError, match="loss metric needs logits over the input vocabulary"):
        loss_metric(tokens)(model(tokens))
