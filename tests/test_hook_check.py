"""The hook self-test on both backends and on every family, against what was measured by hand:
pattern edits reach nothing on the bridge's opt and gpt_neo, GQA keys/values carry the key/value
heads, and the heads' outputs add up to hook_attn_out."""

from __future__ import annotations

import re

import pytest
import torch

import analyses.core.hook_check as hook_check
from analyses.cli import main
from analyses.core.hook_check import check_hooks, require_edit
from interp import load_model
from interp.errors import UserError
from interp.random_models import FAMILIES

PATTERN_EDITS_IGNORED = {"opt", "gpt_neo"}  # measured: the bridge's pattern hook is not on the path


@pytest.fixture(scope="module")
def family_models(family_dir):
    return {family: load_model(family_dir(family)) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_passes_where_its_hooks_work_and_says_where_they_do_not(family_models, family):
    check = check_hooks(family_models[family])
    assert check.family == family
    assert check.shapes_ok, check.shapes[~check.shapes["ok"]]
    assert all(check.reaches_output[hook] for hook in ("hook_q", "hook_k", "hook_v", "hook_z"))
    assert check.reaches_output["hook_pattern"] == (family not in PATTERN_EDITS_IGNORED)
    assert check.sums_ok


def test_grouped_query_keys_and_values_carry_the_key_value_heads(family_models):
    shapes = check_hooks(family_models["llama"]).shapes.set_index("hook")["shape"]
    assert shapes["blocks.0.attn.hook_q"] == (1, 12, 4, 16)
    assert shapes["blocks.0.attn.hook_k"] == shapes["blocks.0.attn.hook_v"] == (1, 12, 2, 16)
    assert check_hooks(family_models["gemma"]).shapes.set_index("hook")["shape"]["blocks.1.attn.hook_k"] == (1, 12, 1, 16)


@pytest.mark.parametrize("family", sorted(PATTERN_EDITS_IGNORED))
def test_an_edit_that_cannot_reach_the_output_is_refused_in_one_line(family_models, family):
    with pytest.raises(UserError, match=f"^patch_patterns needs edits of hook_pattern, which do not reach the output "
                                        f"of this {family} model \\(transformer_lens\\)"):
        require_edit(family_models[family], "hook_pattern", "patch_patterns")
    require_edit(family_models[family], "hook_z", "patch_heads")  # this one reaches the output


def test_the_toy_model_passes_every_check():
    check = check_hooks(load_model("toy"))
    assert check.ok and check.sum_error == 0.0


def test_a_wrong_output_projection_fails_the_sum_check(monkeypatch):
    model = load_model("toy")
    monkeypatch.setattr(type(model.blocks[0].attn), "W_O", property(lambda attn: torch.zeros(8, 16, 128)))
    check = check_hooks(model)
    assert check.sums_ok is False and not check.ok


def test_a_hook_of_the_wrong_shape_is_reported(monkeypatch):
    documented = hook_check.documented_shapes
    monkeypatch.setattr(hook_check, "documented_shapes",
                        lambda cfg, batch, n_pos: documented(cfg, batch, n_pos) | {"attn.hook_k": (batch, n_pos, 3, 7)})
    check = check_hooks(load_model("toy"))
    bad = check.shapes[~check.shapes["ok"]]
    assert sorted(bad["hook"]) == ["blocks.0.attn.hook_k", "blocks.1.attn.hook_k"]
    assert not check.ok


def test_the_check_runs_once_per_model_object():
    model = load_model("toy")
    calls = []
    model.blocks[0].attn.hook_pattern.add_hook(lambda activation, hook: calls.append(1), dir="fwd")
    first = check_hooks(model)
    n_forwards = len(calls)
    assert n_forwards > 0 and check_hooks(model) is first and len(calls) == n_forwards


def test_interp_check_prints_the_verdicts(family_dir, capsys):
    assert main(["check", "--model", str(family_dir("opt"))]) == 0
    out = capsys.readouterr().out
    assert "opt (transformer_lens)" in out and "edit hook_pattern: changes NOTHING" in out
    assert "edit hook_z: changes the output" in out
    assert "QK attribution: refused on this model (QK attribution needs interp's own attention" in out
    assert main(["check", "--model", "toy"]) == 0
    out = capsys.readouterr().out
    assert "hook shapes: all as documented" in out
    said = re.search(r"QK attribution: the terms add up to hook_attn_scores .*max error (\S+) of the largest", out)
    assert said and float(said[1]) < 1e-5


def cold_toy(factor: float):
    """The toy model with its queries scaled by ``factor``: a saturated softmax (one-hot patterns),
    as in Tracr's compiled heads."""
    model = load_model("toy")
    with torch.no_grad():
        for block in model.blocks:
            block.attn.W_query.weight.mul_(factor)
            if block.attn.W_query.bias is not None:
                block.attn.W_query.bias.mul_(factor)
    return model


def test_query_and_key_edits_are_seen_on_saturated_attention():
    """A bounded added pattern is lost on queries of 1e4 (every pattern stays one-hot): the probe
    scales with the activation, so the verdicts are those of the unscaled model."""
    model = cold_toy(1e4)
    _, cache = model.run_with_cache(hook_check.probe_tokens(model))
    assert cache["blocks.1.attn.hook_pattern"].amax(-1).min() > 0.999  # saturated
    check = check_hooks(model)
    assert check.ok and all(check.reaches_output.values())


def test_dead_query_and_key_hooks_are_refused_on_saturated_attention_too(monkeypatch):
    """Hooks that fire but whose edits the attention never reads (as a bridge's can be): the edit
    is measured where the model computes, so scaling the probe cannot make a dead hook pass."""
    attention = type(load_model("toy").blocks[0].attn)
    heads = attention._heads

    def discard_query_key_edits(self, x, hook):
        hooked = heads(self, x, hook)
        return heads(self, x, lambda value: value) if hook in (self.hook_q, self.hook_k) else hooked
    monkeypatch.setattr(attention, "_heads", discard_query_key_edits)
    for factor in (1.0, 1e4):
        check = check_hooks(cold_toy(factor))
        assert check.reaches_output == {"hook_q": False, "hook_k": False, "hook_v": True, "hook_z": True,
                                        "hook_pattern": True}, factor
        assert max(check.effects["hook_q"], check.effects["hook_k"]) <= hook_check.EDIT_TOLERANCE
    with pytest.raises(UserError, match="^path patching needs edits of hook_q"):
        require_edit(cold_toy(1.0), "hook_q", "path patching")


def test_tracr_heads_pass_where_one_probe_leaves_the_output_unchanged():
    """count_less_freq on the probe "abcab": every count is the largest, so a key edit at the
    last layer moves its attention but not the output; the edit is seen at the layer's output."""
    pytest.importorskip("tracr", reason="needs the [tracr] extra")
    from interp.tracr import compile_program, from_tracr
    for name, vocab in (("count_less_freq", "abc"), ("shuffle_dyck2", "(){}")):
        check = check_hooks(from_tracr(compile_program(name, list(vocab), 5)))
        assert check.ok, (name, check.effects)
