"""QK attribution (``analyses.qk_attribution``): a head's pre-softmax score split over its input's
components adds up to the score the model computes (hook_attn_scores; before Gemma 2's cap, from the
model's rotated queries and keys by hand; for GPT-2 also from Hugging Face's own q/k projections) and
to the contrast against the other keys, on every family the from-scratch model runs and on a GGUF
file; a planted induction head whose key reads a previous-token head names that head; refusals are
one line."""

from __future__ import annotations

import pytest
import torch
from gguf_writer import write_gguf
from transformers import AutoConfig, AutoModelForCausalLM

from analyses import decompose_residual, qk_attribution
from analyses.core.execution import executing
from analyses.components.decompose import component_hooks
from interp import UserError, load_model
from interp.convert import from_hf, scratch_families
from interp.model import GPTConfig, GPTModel
from interp.random_models import family_tokenizer, random_hf_model

LAYER, HEAD = 1, 3  # the last layer of the tiny models; head 3 reads key/value group 1 of 2 (0 of 1 on Gemma)
N_PROMPTS, N_POS, N_PAIRS = 3, 12, 4


def sharp(family: str):
    """(Hugging Face model, tokenizer) of ``family`` with weights large enough that the scores are O(1)."""
    if family == "bloom":  # not among random_models' families: as tests/test_gguf.py makes it
        config = AutoConfig.for_model("bloom", vocab_size=320, n_layer=2, hidden_size=64, n_head=4,
                                      initializer_range=0.3, bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval(), family_tokenizer("llama")
    return random_hf_model(family, initializer_range=0.3)


def pairs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens (prompts, pos), query_pos, key_pos (prompts, pairs)): random visible pairs, every
    query past position 0 (so it sees another key)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(10, 300, (N_PROMPTS, N_POS), generator=generator)
    query = torch.randint(1, N_POS, (N_PROMPTS, N_PAIRS), generator=generator)
    key = (torch.rand(N_PROMPTS, N_PAIRS, generator=generator) * (query + 1)).long()
    return tokens, query, key


def by_hand(model, tokens: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(score, contrast) (prompts, pairs) from the model's own forward, not through qk_attribution: its
    hook_attn_scores, or where it caps them its rotated queries and keys times its scale plus nothing
    (no family caps and has ALiBi); the contrast against the mean of the other unmasked keys."""
    attn = model.blocks[LAYER].attn
    _, cache = model.run_with_cache(tokens)
    scores = cache[f"blocks.{LAYER}.attn.hook_attn_scores"][:, HEAD].double()
    if attn.soft_cap is not None:
        q = cache[f"blocks.{LAYER}.attn.hook_rot_q"][:, :, HEAD].double()
        k = cache[f"blocks.{LAYER}.attn.hook_rot_k"][:, :, HEAD // attn.group_size].double()
        scores = torch.where(torch.isfinite(scores), attn.scale * q @ k.transpose(1, 2), scores)
    rows = torch.arange(len(tokens))[:, None]
    score = scores[rows, query, key]
    contrast = torch.empty_like(score)
    for b in range(len(tokens)):
        for p in range(query.shape[1]):
            row = scores[b, query[b, p]]
            others = [j for j in range(row.shape[0]) if torch.isfinite(row[j]) and j != key[b, p]]
            contrast[b, p] = score[b, p] - row[others].mean()
    return score, contrast


def assert_adds_up(result, expected: torch.Tensor) -> None:
    total = result.terms.double().sum((2, 3))
    tolerance = 1e-4 * float(expected.abs().max()) + 1e-5
    assert float(expected.abs().max()) > 0.1  # a real test: scores far from zero
    torch.testing.assert_close(total, expected.double(), atol=tolerance, rtol=0)
    torch.testing.assert_close(result.score.double(), expected.double(), atol=tolerance, rtol=0)


@pytest.mark.parametrize("family", scratch_families())
def test_terms_add_up_to_the_score_and_the_contrast_on_every_family(family):
    model = from_hf(*sharp(family))
    tokens, query, key = pairs()
    score, contrast = by_hand(model, tokens, query, key)
    plain = qk_attribution(model, tokens, LAYER, HEAD, query, key)
    assert plain.terms.shape == (N_PROMPTS, N_PAIRS, len(plain.names), len(plain.names))
    assert plain.terms.dtype == torch.float32
    assert_adds_up(plain, score)
    assert_adds_up(qk_attribution(model, tokens, LAYER, HEAD, query, key, baseline="mean_other_keys"), contrast)
    residual = list(decompose_residual(model, tokens, layer=LAYER).components["component"])
    assert list(plain.names[:len(residual)]) == residual  # named as the residual decomposition names them
    assert ("alibi" in plain.names) == (family == "bloom")
    assert ("soft cap" in plain.note) == (family == "gemma2")


def test_gpt2_score_equals_a_hand_score_from_hugging_faces_own_projections():
    hf, tokenizer = sharp("gpt2")
    tokens, query, key = pairs(1)
    result = qk_attribution(from_hf(hf, tokenizer), tokens, LAYER, HEAD, query, key)
    with torch.no_grad():
        hidden = hf(tokens, output_hidden_states=True).hidden_states[LAYER]  # the residual entering block LAYER
        block = hf.transformer.h[LAYER]
        q, k, _ = block.attn.c_attn(block.ln_1(hidden)).split(hf.config.n_embd, dim=2)
    d_head = hf.config.n_embd // hf.config.n_head
    q, k = (t[..., HEAD * d_head:(HEAD + 1) * d_head].double() for t in (q, k))
    rows = torch.arange(N_PROMPTS)[:, None]
    expected = (q[rows, query] * k[rows, key]).sum(-1) / d_head ** 0.5
    assert_adds_up(result, expected)


def test_terms_add_up_on_a_gguf_file(tmp_path):
    hf, tokenizer = random_hf_model("llama", initializer_range=0.3)
    model = load_model(write_gguf(hf, tokenizer, tmp_path / "llama.gguf", "Q8_0", name="llama"))
    tokens, query, key = pairs(2)
    score, contrast = by_hand(model, tokens, query, key)
    assert_adds_up(qk_attribution(model, tokens, LAYER, HEAD, query, key), score)
    assert_adds_up(qk_attribution(model, tokens, LAYER, HEAD, query, key, baseline="mean_other_keys"), contrast)


def test_chunking_over_prompts_gives_the_same_terms():
    model = from_hf(*sharp("llama"))
    tokens, query, key = pairs(3)
    whole = qk_attribution(model, tokens, LAYER, HEAD, query, key)
    chunked = qk_attribution(model, tokens, LAYER, HEAD, query, key, memory_mb=1e-6)  # one prompt a chunk
    torch.testing.assert_close(chunked.terms, whole.terms, atol=1e-6, rtol=0)


def test_decomposition_of_a_layers_input_adds_up_to_its_resid_pre():
    model = from_hf(*sharp("gpt_neox"))
    tokens = pairs()[0]
    parts = decompose_residual(model, tokens, layer=1)
    _, cache = model.run_with_cache(tokens)
    torch.testing.assert_close(parts.parts.sum(0), cache["blocks.1.hook_resid_pre"], atol=1e-5, rtol=0)
    assert list(parts.components["component"]) == ["embed", *(f"L0H{h}" for h in range(4)), "L0 attn bias", "L0 MLP"]
    assert "blocks.1.hook_resid_pre" in component_hooks(model, layer=1)


# ---- a planted induction head reading a planted previous-token head --------------------------------

V, N_CTX = 12, 16
TOK, POS, PREV, DECOY = 0, V, V + N_CTX, 2 * V + N_CTX  # the residual's subspaces
D_HEAD, BIG = 32, 200.0


def planted() -> GPTModel:
    """Attention-only, no norms, no biases. The token embedding writes e_t into TOK, the position
    embedding e_p into POS. L0H0 (previous-token): its query e_p and key e_{p'+1} read from POS, its
    value the token, written into PREV: at position p it writes the token at p - 1. L0H1 (a decoy
    current-token head): uniform attention, the token average written into DECOY. L1H0 (induction):
    its query reads the current token from TOK, its key the previous token from PREV. By
    construction L1H0's query reads only what ``embed`` writes and its key only what L0H0 writes."""
    model = GPTModel(GPTConfig(d_vocab=V, n_ctx=N_CTX, d_model=64, n_heads=2, d_head=D_HEAD, n_layers=2,
                               attn_only=True, qkv_bias=False, normalization_type=None, attn_out_bias=False))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model.embed.weight[:, TOK:TOK + V] = torch.eye(V)
        model.pos_embed.weight[:, POS:POS + N_CTX] = torch.eye(N_CTX)
        first, second = model.blocks[0].attn, model.blocks[1].attn
        for p in range(N_CTX):
            first.W_query.weight[p, POS + p] = BIG
            if p + 1 < D_HEAD:
                first.W_key.weight[p + 1, POS + p] = 1.0
        for t in range(V):
            first.W_value.weight[t, TOK + t] = 1.0  # head 0's value
            first.W_value.weight[D_HEAD + t, TOK + t] = 1.0  # head 1's value
            first.out_proj.weight[PREV + t, t] = 1.0
            first.out_proj.weight[DECOY + t, D_HEAD + t] = 1.0
            second.W_query.weight[t, TOK + t] = BIG
            second.W_key.weight[t, PREV + t] = 1.0
    return model.eval()


def test_a_planted_induction_heads_key_side_names_the_previous_token_head():
    generator = torch.Generator().manual_seed(0)
    segment = torch.stack([torch.randperm(V, generator=generator)[:5] for _ in range(4)])  # distinct tokens
    tokens = torch.cat([segment, segment], dim=1)  # (4, 10): a segment, then again
    query = torch.arange(6, 10).repeat(4, 1)  # the second copy (its first token has no earlier successor)
    key = query - 5 + 1  # the token after the first occurrence of the query's token
    model = planted()
    result = qk_attribution(model, tokens, 1, 0, query, key)
    assert result.names[:3] == ("embed", "pos_embed", "L0H0")
    key_side, query_side = result.key_side(), result.query_side()
    assert key_side["component"].iloc[0] == "L0H0" and query_side["component"].iloc[0] == "embed"
    assert result.top_pairs(1)[["query_component", "key_component"]].values.tolist() == [["embed", "L0H0"]]
    # every other term is zero by construction, and the one term is the score
    others = result.terms.clone()
    others[:, :, result.names.index("embed"), result.names.index("L0H0")] = 0
    assert float(others.abs().max()) < 1e-4
    # the induction head's score there: BIG / sqrt(d_head) times the previous-token head's (saturated) attention
    torch.testing.assert_close(result.score, torch.full_like(result.score, BIG / D_HEAD ** 0.5), rtol=1e-3, atol=0)


# ---- refusals ----------------------------------------------------------------------------------------

def test_a_bridge_model_is_refused_in_one_line(bridge_gpt2):
    with pytest.raises(UserError) as error:
        qk_attribution(bridge_gpt2, torch.zeros(1, 4, dtype=torch.long), 1, 0, [[3]], [[1]])
    assert "\n" not in str(error.value) and "impl='scratch'" in str(error.value)


@pytest.mark.parametrize("change, said", [
    (dict(query=[[1]], key=[[3]]), "masked"),
    (dict(baseline="mean"), "baseline"),
    (dict(head=9), "head L1H9 out of range"),
    (dict(query=[[1, 2]], key=[[1]]), "shape"),
    (dict(query=[[0]], key=[[0]], baseline="mean_other_keys"), "another key"),
])
def test_bad_pairs_and_options_are_refused_in_one_line(scratch_gpt2, change, said):
    options = dict(query=[[3]], key=[[1]], baseline=None, head=0) | change
    with pytest.raises(UserError) as error:
        qk_attribution(scratch_gpt2, torch.zeros(1, 4, dtype=torch.long), 1, options["head"], options["query"],
                       options["key"], baseline=options["baseline"])
    assert "\n" not in str(error.value) and said in str(error.value)


# ---- confirmed by intervention -----------------------------------------------------------------------

def test_the_planted_heads_removal_from_the_key_input_agrees_with_the_attribution():
    from analyses.circuits.qk_check import qk_intervention_check

    generator = torch.Generator().manual_seed(1)
    segment = torch.stack([torch.randperm(V, generator=generator)[:5] for _ in range(6)])
    tokens = torch.cat([segment, segment], dim=1)
    query = torch.arange(6, 10).repeat(6, 1)
    check = qk_intervention_check(planted(), tokens, 1, 0, query, query - 4, side="key", k=1, n_boot=200)
    drops = check.frame.set_index("component")["drop"]
    # removing L0H0 from the key input alone leaves the induction head no reason to prefer the target:
    # its attention falls from ~1 to uniform over the keys it sees; removing anything else moves nothing
    assert drops["L0H0"] > 0.5 and drops.drop("L0H0").abs().max() < 1e-6
    assert check.overlap == 1.0 and check.overlap_ci == (1.0, 1.0)


@pytest.mark.parametrize("side", ["key", "query"])
def test_the_drops_run_from_the_heads_layer_equal_full_forwards_with_hand_written_hooks(side):
    """The check's removals start at the head's layer (the engine's suffix-only run); a full forward
    from the tokens under a plain hook subtracting the part from this head's own input must agree."""
    from analyses.circuits.qk_check import _drops

    model = from_hf(*sharp("llama"))  # RoPE and grouped keys: head 3 reads key/value group 1
    tokens, query, key = pairs()
    parts = decompose_residual(model, tokens, layer=LAYER).parts
    which, rows = ("k" if side == "key" else "q"), torch.arange(N_PROMPTS)[:, None]

    def attention(part=None) -> torch.Tensor:
        def edit(copies, hook):
            copies[:, :, HEAD] -= part
            return copies
        hooks = [] if part is None else [(f"blocks.{LAYER}.hook_{which}_input", edit)]
        model.set_use_split_qkv_input(True)
        try:
            with model.hooks(fwd_hooks=hooks):
                _, cache = model.run_with_cache(tokens)
        finally:
            model.set_use_split_qkv_input(False)
        return cache[f"blocks.{LAYER}.attn.hook_pattern"][:, HEAD].double()[rows, query, key].mean(1)

    expected = torch.stack([attention() - attention(part) for part in parts], dim=1)
    assert float(expected.abs().max()) > 0.01  # some removal moves the attention
    with executing(memory_mb=64.0):
        drops = _drops(model, tokens, LAYER, HEAD, query, key, side)
    torch.testing.assert_close(drops, expected, atol=1e-6, rtol=0)


def test_role_pairs_are_the_roles_targets():
    from analyses.circuits.qk_check import role_pairs
    from analyses.core.probes import probes_for

    probes = probes_for(planted(), 4, 16)
    query, key = role_pairs(probes, "induction")
    rows = torch.arange(4)[:, None]
    assert (probes.tokens[rows, key - 1] == probes.tokens[rows, query]).all() and (key < query).all()
    query, key = role_pairs(probes, "previous_token", max_pairs=3)
    assert query.shape == (4, 3) and (key == query - 1).all()


# ---- the command -------------------------------------------------------------------------------------

def test_the_qk_command_writes_its_tables_figure_and_check(tmp_path, capsys):
    import json

    import pandas as pd

    from analyses.cli import main

    code = main(["qk", "--model", "toy", "--head", "1.5", "--prompts", "4", "--seq-len", "24", "--max-pairs", "3",
                 "--check", "--out", str(tmp_path), "--quiet"])
    assert code == 0
    sides = pd.read_csv(tmp_path / "attribution.csv")
    assert set(sides["side"]) == {"query", "key"} and (sides["ci_low"] <= sides["ci_high"]).all()
    assert len(pd.read_csv(tmp_path / "top_pairs.csv")) == 10
    assert (tmp_path / "qk.png").read_bytes()[:4] == b"\x89PNG"
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["head"] == [1, 5] and set(meta["check"]) == {"key", "query"}
    assert "Spearman" in capsys.readouterr().out


def test_the_qk_command_reads_pairs_from_a_file_and_refuses_unequal_ones(tmp_path, capsys):
    from analyses.cli import main

    good = tmp_path / "pairs.csv"
    good.write_text("text,query_pos,key_pos\nabcabc,4,2\nabcabc,5,3\nxyzxyz,4,2\nxyzxyz,5,3\n")
    assert main(["qk", "--model", "toy", "--head", "1.0", "--pairs", str(good), "--out", str(tmp_path / "o"),
                 "--quiet"]) == 0
    bad = tmp_path / "bad.csv"
    bad.write_text("text,query_pos,key_pos\nabcabc,4,2\nxyzxyz,4,2\nxyzxyz,5,3\n")
    assert main(["qk", "--model", "toy", "--head", "1.0", "--pairs", str(bad), "--out", str(tmp_path / "p"),
                 "--quiet"]) == 2
    error = capsys.readouterr().err.strip()
    assert "as many pairs" in error and "\n" not in error and not (tmp_path / "p").exists()


@pytest.mark.parametrize("text, message", [
    ("txt,q,k\nabc,1,0\n", "the header lacks text, query_pos, key_pos; it needs text, query_pos, key_pos, and has "
                           "'txt', 'q', 'k'"),
    ("", "the header lacks text, query_pos, key_pos; it needs text, query_pos, key_pos, and has no header "
         "(the file is empty)"),
    ("text,query_pos,key_pos\n", "no rows; it needs rows of text, query_pos, key_pos"),
])
def test_a_pairs_file_with_a_wrong_header_says_what_it_needs_and_what_it_found(tmp_path, capsys, text, message):
    """As a task or facts file's header is refused: what it lacks, what it needs, what it has; an
    empty file is one line, not pandas' EmptyDataError."""
    from analyses.cli import main

    pairs = tmp_path / "pairs.csv"
    pairs.write_text(text)
    assert main(["qk", "--model", "toy", "--head", "1.0", "--pairs", str(pairs), "--out", str(tmp_path / "o"),
                 "--quiet"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.endswith(f"pairs file {str(pairs)!r}: {message}"), error
    assert "\n" not in error
