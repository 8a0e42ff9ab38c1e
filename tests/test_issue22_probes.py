"""Issue 22, items 1 and 3.

1. Every edit probe adds a fixed pattern (never zeros or scales), so a model whose activation is
   already zero where the probe edits (an MLP with zero weights, a last layer whose values are
   zero) is not refused: Hugging Face GPT-2 and Llama directories with zeroed MLPs get a report.
3. Every hook point of ``GPTModel`` hands its hook a tensor of its own: an in-place edit of one
   prompt changes that prompt's output alone, and an in-place edit of one position raises nothing
   and changes no earlier position.
"""

from __future__ import annotations

import json

import pytest
import torch

from analyses.roles.backup import mlp_out_names, require_mlp_freeze
from analyses.cli import main
from analyses.core.hook_check import EDITABLE, added_pattern, check_hooks
from interp import GPTConfig, GPTModel
from interp.random_models import random_hf_model


# ------------------------------------------------------------------------------ item 1
@pytest.fixture(scope="module")
def zero_mlp_dirs(tmp_path_factory):
    """family -> a save_pretrained directory of a random model whose every MLP weight is zero."""
    made = {}
    for family in ("gpt2", "llama"):
        model, tokenizer = random_hf_model(family, seed=3, n_ctx=64)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".mlp." in name:
                    param.zero_()
        directory = tmp_path_factory.mktemp(f"zero_mlp_{family}")
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        made[family] = directory
    return made


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_model_whose_mlps_write_zero_gets_a_full_report(zero_mlp_dirs, family, tmp_path):
    out = tmp_path / "report"
    assert main(["report", "--model", str(zero_mlp_dirs[family]), "--prompts", "4", "--seq-len", "24",
                 "--out", str(out)]) == 0
    assert (out / "index.html").is_file() and (out / "head_roles.csv").is_file()
    meta = json.loads((out / "meta.json").read_text())
    assert meta["family"] == family


def _toy(seed: int = 0, **knobs) -> GPTModel:
    torch.manual_seed(seed)
    cfg = GPTConfig(d_vocab=300, n_ctx=32, d_model=32, n_heads=4, n_layers=2, **knobs)
    return GPTModel(cfg).eval()


def test_the_mlp_probe_passes_where_the_last_mlp_writes_zero():
    model = _toy()
    with torch.no_grad():
        for param in model.blocks[-1].mlp.parameters():
            param.zero_()
    require_mlp_freeze(model, mlp_out_names(model))  # a zero edit of a zero output changed nothing: refused


def test_edits_reach_the_output_where_the_last_layer_reads_no_values():
    """Last layer's value weights zero: no edit of its queries, keys or pattern can move its output,
    but the hooks work (layer 0 shows it), so nothing is refused."""
    model = _toy()
    with torch.no_grad():
        model.blocks[-1].attn.W_value.weight.zero_()
        model.blocks[-1].attn.W_value.bias.zero_()
    check = check_hooks(model)
    assert all(check.reaches_output[hook] for hook in EDITABLE), check.effects
    assert check.ok


def test_the_probe_changes_every_activation_whatever_its_value():
    for value in (torch.zeros(2, 5, 4, 8), torch.ones(2, 4, 5, 5) / 5, -torch.full((3, 7), 2.0)):
        edited = added_pattern(value)
        change = edited - value
        size = max(1.0, value.abs().max().item())  # the pattern scales with the activation (a saturated softmax too)
        assert edited.shape == value.shape and (change >= size).all() and (change < 3 * size).all()
        assert change.flatten().unique().numel() == change.numel()  # varies along every axis


# ------------------------------------------------------------------------------ item 3
HOOK_CONFIGS = {
    "gpt2": {},
    "rotary_gqa": dict(positional_embedding_type="rotary", n_key_value_heads=2, normalization_type="RMS",
                       gated_mlp=True, act_fn="silu", qkv_bias=False, tie_word_embeddings=False),
    "alibi": dict(positional_embedding_type="alibi", post_embedding_ln=True),
    "parallel": dict(parallel_attn_mlp=True, positional_embedding_type="rotary", rotary_dim=4),
    "attn_only": dict(attn_only=True),
    "split_qkv": dict(n_key_value_heads=2, use_split_qkv_input=True, embed_scale=2.0),
    "sliding_window": dict(positional_embedding_type="rotary", sliding_window=3),
}
BATCH, N_POS, EDITED_POS = 3, 7, 4


def _position_axis(activation: torch.Tensor, name: str) -> int:
    """Scores and patterns are (batch, head, q, k): their query axis; every other hook (batch, pos, ...)."""
    return 2 if name.endswith(("hook_attn_scores", "hook_pattern")) else 1


def _in_place(edit):
    def hook(activation, hook):
        edit(activation, hook.name)  # returns None: the activation itself goes on

    return hook


def _fixed(shape, device, dtype) -> torch.Tensor:
    return added_pattern(torch.zeros(shape, device=device, dtype=dtype))


@pytest.fixture(scope="module", params=sorted(HOOK_CONFIGS))
def hooked(request):
    model = _toy(seed=5, **HOOK_CONFIGS[request.param])
    tokens = torch.randint(0, 300, (BATCH, N_POS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens)
    return model, tokens, logits, list(cache)  # the hook points of model.hook_dict that fire on this config


def test_every_config_fires_the_hook_points_it_should(hooked):
    model, _, _, fired = hooked
    assert "hook_embed" in fired and "blocks.1.attn.hook_pattern" in fired
    assert ("hook_pos_embed" in fired) == (model.cfg.positional_embedding_type == "standard")
    assert ("blocks.0.hook_v_input" in fired) == model.cfg.use_split_qkv_input
    assert ("blocks.0.attn.hook_rot_k" in fired) == (model.cfg.positional_embedding_type == "rotary")


def test_an_in_place_edit_of_one_prompt_changes_that_prompt_alone(hooked):
    model, tokens, clean, fired = hooked
    for name in fired:
        def edit(activation, _):
            activation[1] += _fixed(activation[1].shape, activation.device, activation.dtype)

        with torch.no_grad():
            edited = model.run_with_hooks(tokens, fwd_hooks=[(name, _in_place(edit))])
        assert (edited[1] - clean[1]).abs().max() > 1e-3, f"{name}: the edited prompt did not change"
        torch.testing.assert_close(edited[[0, 2]], clean[[0, 2]], rtol=0, atol=1e-5,
                                   msg=lambda m: f"{name}: an in-place edit of prompt 1 moved other prompts\n{m}")


def test_an_in_place_edit_of_one_position_changes_no_earlier_position(hooked):
    model, tokens, clean, fired = hooked
    for name in fired:
        def edit(activation, hook_name):
            axis = _position_axis(activation, hook_name)
            row = activation.select(axis, EDITED_POS)
            row += _fixed(row.shape, activation.device, activation.dtype)

        with torch.no_grad():
            edited = model.run_with_hooks(tokens, fwd_hooks=[(name, _in_place(edit))])
        assert (edited[:, EDITED_POS:] - clean[:, EDITED_POS:]).abs().max() > 1e-3, f"{name}: nothing changed"
        torch.testing.assert_close(edited[:, :EDITED_POS], clean[:, :EDITED_POS], rtol=0, atol=1e-5,
                                   msg=lambda m: f"{name}: an edit of position {EDITED_POS} moved earlier ones\n{m}")


def test_a_run_that_starts_at_a_layer_never_edits_the_callers_residual():
    model = _toy(seed=5)
    tokens = torch.randint(0, 300, (2, N_POS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter="blocks.1.hook_resid_pre")
        start = cache["blocks.1.hook_resid_pre"].clone()
        kept = start.clone()
        expanded = start[:1].expand(2, -1, -1)  # one prompt's residual, shared by two rows

        def edit(activation, _):
            activation[0] += 1.0

        model.run_with_hooks(start, start_at_layer=1, fwd_hooks=[("blocks.1.hook_resid_pre", _in_place(edit))])
        assert torch.equal(start, kept)
        edited = model.run_with_hooks(expanded, start_at_layer=1,
                                      fwd_hooks=[("blocks.1.hook_resid_pre", _in_place(edit))])
        plain = model(expanded, start_at_layer=1)
    assert not torch.equal(edited[0], plain[0]) and torch.equal(edited[1], plain[1])
