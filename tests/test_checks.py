"""The argument checks every room shares (``analyses.core.checks``): one line naming the bad value
and what is allowed, and the rooms' own checks of a choice or a layer are these, word for word."""

import re

import pytest
import torch

from analyses.components.decompose import component_hooks
from analyses.components.qk import qk_attribution
from analyses.core.checks import check_choice, check_heads, check_layer
from analyses.circuits.edges import check_vias
from analyses.roles.tl_compat import detect_heads
from interp import UserError, load_model


@pytest.fixture(scope="module")
def model():
    model = load_model("toy").eval()
    assert (model.cfg.n_layers, model.cfg.n_heads) == (2, 8)
    return model


def test_a_choice_outside_the_allowed_names_them_in_one_line():
    check_choice("edge method", "eap", ("patch", "eap"))
    with pytest.raises(UserError, match=re.escape("unknown edge method 'x'; allowed: patch, eap")) as error:
        check_choice("edge method", "x", ("patch", "eap"))
    assert "\n" not in str(error.value)


def test_heads_and_layers_are_checked_against_the_models_shape(model):
    assert check_heads(model, ["L1H7", (0, 0)]) == [(1, 7), (0, 0)]
    for written in ((2, 0), "L2H0", "2.0"):  # printed in the one form, whatever form it was given in
        with pytest.raises(UserError, match=re.escape("head L2H0 out of range: layer must be in [0, 2), head in [0, 8)")):
            check_heads(model, [written])
    check_layer(model, 1)
    for layer in (-1, 2):
        with pytest.raises(UserError, match=re.escape(f"layer={layer} must be in [0, 2)")):
            check_layer(model, layer)


def test_the_rooms_refuse_a_bad_choice_or_layer_with_the_shared_line(model):
    """Each room's refusal is ``check_choice``'s or ``check_layer``'s line, not a copy of it."""
    with pytest.raises(UserError, match=re.escape("unknown via 'z'; allowed: q, k, v, logits")):
        check_vias(["q", "z"])
    with pytest.raises(UserError, match=re.escape("unknown error_measure 'l1'; allowed: mul, abs")):
        detect_heads(model, "a b a b", error_measure="l1")
    with pytest.raises(UserError, match=re.escape("layer=2 must be in [0, 2)")):
        component_hooks(model, layer=2)
    with pytest.raises(UserError, match=re.escape("layer=5 must be in [0, 2)")):
        qk_attribution(model, torch.zeros(1, 4, dtype=torch.long), 5, 0, 3, 1)


def test_a_layer_or_head_out_of_range_reads_the_same_in_every_room(model):
    """The attention map's layer and the QK attribution's head are refused in ``check_layer``'s and
    ``check_heads``' words, as every other room's, not in a wording of their own (a closed range
    "[0, 1]" beside the others' "[0, 2)", "head=9" beside "head L1H9")."""
    from analyses.report.attention_map import attention_map

    with pytest.raises(UserError, match=re.escape("layer=2 must be in [0, 2)")):
        attention_map(model, "the cat sat", layer=2)
    with pytest.raises(UserError, match=re.escape("head L1H9 out of range: layer must be in [0, 2), head in [0, 8)")):
        qk_attribution(model, torch.zeros(1, 4, dtype=torch.long), 1, 9, 3, 1)


def test_patching_given_probes_for_tokens_says_so_in_one_line(model):
    """The ablations take probes; the patching functions take token ids: given probes there, they
    refuse in one line that names what they got and where its ids are, not torch's "Could not infer
    dtype of RepeatedProbes"."""
    from analyses import corrupt_first_copy, loss_metric, patch_heads, path_patch, probes_for

    probes = probes_for(model, 4, seed=0)
    metric = loss_metric(probes.tokens, probes.predictable)
    said = re.escape("tokens must be integer ids of shape (batch, pos), got a RepeatedProbes; its .tokens holds them")
    for call in (patch_heads, lambda *a: path_patch(*a, via="logits")):
        with pytest.raises(UserError, match=f"^{said}$"):
            call(model, probes, corrupt_first_copy(probes), metric)
    with pytest.raises(UserError, match=re.escape("got a list")):
        patch_heads(model, [[1, 2], [3]], corrupt_first_copy(probes), metric)
