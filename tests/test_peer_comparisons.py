"""The comparison code of ``benchmarks/peer_smollm2.py`` (interp against TransformerLens on
SmolLM2's real weights), run on a tiny random Llama with grouped-query attention (4 query heads
over 2 key/value heads) loaded as the benchmark loads SmolLM2: interp's results equal the peer's to
1e-4 where both compute the same numbers (``detect_heads``, ``patch_heads``, ``path_patch`` through
the query, on GPTModel and on the bridge), TransformerLens refuses key and value paths on a
grouped-query model with the error the benchmark reports, and the rank agreement notices a swap."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from analyses.tasks.task import ioi_task, task_batch, task_metric
from interp.random_models import save_random_model

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def peer():
    """benchmarks/peer_smollm2.py as a module (it imports its neighbour ``common``)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        spec = importlib.util.spec_from_file_location("peer_smollm2", BENCHMARKS / "peer_smollm2.py")
        module = importlib.util.module_from_spec(spec)
        patch.setitem(sys.modules, spec.name, module)  # where its dataclass looks up its annotations
        spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_random_model("llama", tmp_path_factory.mktemp("llama_gqa"), seed=7, num_hidden_layers=3,
                             initializer_range=0.3)


@pytest.fixture(scope="module")
def pair(peer, llama_dir):
    """(GPTModel, bridge) of a 3-layer random Llama, 4 query heads over 2 key/value heads; weights of
    std 0.3 so that attention is far from uniform and effects are far above 1e-4."""
    scratch, bridge = peer.load_pair(str(llama_dir))
    assert scratch.cfg.n_key_value_heads == 2 < scratch.cfg.n_heads == 4
    return scratch, bridge


@pytest.fixture(scope="module")
def ioi(pair):
    scratch, bridge = pair
    task = ioi_task(scratch, n=3)
    batch = task_batch(scratch, task)
    assert torch.equal(task_batch(bridge, task).clean, batch.clean)
    return batch.clean, batch.corrupted, task_metric(task, batch.last)


def check_exact(rows, peer_module) -> None:
    """Every exact comparison within 1e-4, on both backends; and the peer's values vary by far
    more (not a vacuous comparison)."""
    exact = [row for row in rows if row.exact]
    assert {row.ours.rsplit(" on ", 1)[1] for row in exact} == {"GPTModel", "the bridge"}
    for row in exact:
        assert row.agreement["max_abs_error"] <= peer_module.TOLERANCE, (row.section, row.ours, row.agreement)
        assert row.agreement["same_order"] == 1.0, (row.section, row.ours)


def test_classification_equals_detect_head(peer, pair):
    scratch, bridge = pair
    probes, texts = peer.word_probes(bridge, 3, 16)
    rows = peer.classification({"GPTModel": scratch, "the bridge": bridge}, bridge, probes, texts, 5, 1)
    check_exact(rows, peer)
    assert len(rows) == 2 * 2 * 3  # (detect_heads, classify_heads) x 2 models x 3 patterns
    scores = rows[0].peer_time.result
    assert scores["previous_token_head"].std() > 1e-2 and scores["induction_head"].std() > 1e-2


def test_head_and_path_patching_equal_transformer_lens(peer, pair, ioi):
    scratch, bridge = pair
    models = {"GPTModel": scratch, "the bridge": bridge}
    rows, baseline = peer.head_patching(models, bridge, *ioi, 5, 1)
    check_exact(rows, peer)
    swept = rows[0].peer_time.result
    assert (swept - baseline).abs().max() > 1e-2
    ranked = peer.ranked_heads(rows[0].ours_time.result, baseline)
    assert ranked == peer.ranked_heads(swept, baseline)  # the same heads in the same order
    senders = peer.top_senders(ranked, scratch.cfg.n_layers, 2)
    assert len(senders) == 2 and all(layer < scratch.cfg.n_layers - 1 for layer, _ in senders)
    paths = peer.path_patching(models, bridge, *ioi, senders, baseline, 5, 1)
    check_exact(paths, peer)
    assert (paths[0].peer_time.result - baseline).abs().max() > 1e-2


def test_transformer_lens_refuses_key_and_value_paths_on_grouped_query(peer, pair, ioi):
    _, bridge = pair
    refusals = peer.direct_path_refusals(bridge, *ioi, (0, 1))
    for via in ("k", "v"):
        assert refusals[via].startswith(f"ValueError: component={via!r} is unsupported here"), refusals[via]
        assert "n_key_value_heads=2 for n_heads=4 (GQA/MQA)" in refusals[via]


def test_agreement_sees_a_swap_of_the_top_cells(peer):
    peer_values = torch.tensor([[0.9, -0.5, 0.1], [0.05, 0.3, 0.0]])
    swapped = peer_values.clone()
    swapped[0, 0], swapped[0, 1] = -0.5, 0.9  # the same top set, in another order
    found = peer.agreement(swapped, peer_values, 0.0, 2)
    assert found["top2_overlap"] == 1.0 and found["same_order"] == 0.0
    assert found["max_abs_error"] == pytest.approx(1.4)
    assert peer.agreement(peer_values, peer_values, 0.0, 2)["same_order"] == 1.0


def test_forward_equals_hugging_face(peer, pair, llama_dir):
    scratch, _ = pair
    tokens = torch.randint(3, scratch.cfg.d_vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    hf = peer.hugging_face_model(str(llama_dir), "float32")
    assert not any("Bridge" in type(module).__name__ for module in hf.modules())  # transformers' own, unwrapped
    row = peer.forward(scratch, hf, tokens, 1)
    assert row.exact and row.agreement["max_abs_error"] <= peer.TOLERANCE, row.agreement
    assert row.agreement["argmax_agreement"] == 1.0
    assert row.peer_time.result.std() > 0.1  # logits far from constant: the comparison can fail


def test_bfloat16_pair_runs_everyone_in_bfloat16(peer, pair, llama_dir):
    """``--dtype bfloat16``: every model's weights are bfloat16, and the forwards (the same maths,
    rounded in other orders) stay within bfloat16's rounding of the float32 logits, not equal."""
    scratch, bridge = peer.load_pair(str(llama_dir), "bfloat16")
    hf = peer.hugging_face_model(str(llama_dir), "bfloat16")
    assert {p.dtype for model in (scratch, bridge, hf) for p in model.parameters()} == {torch.bfloat16}
    tokens = torch.randint(3, scratch.cfg.d_vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    row = peer.forward(scratch, hf, tokens, 1)
    float32 = pair[0](tokens)
    assert 0 < row.agreement["max_abs_error"] < 0.05 * float32.abs().max().item(), row.agreement
    assert row.agreement["argmax_agreement"] > 0.9


def test_word_probes_follow_a_model_whose_texts_have_no_start_token(peer, pair, monkeypatch):
    """SmolLM2's GGUF says not to add its start token: the probes then begin with a word, and their
    texts still tokenise back to them (the script once put the start token first and failed there)."""
    _, bridge = pair
    with_start, _ = peer.word_probes(bridge, 2, 12)
    assert with_start.tokens[0, 0].item() == bridge.tokenizer.bos_token_id
    monkeypatch.setattr(bridge.cfg, "default_prepend_bos", False)
    without, texts = peer.word_probes(bridge, 2, 12)
    assert (without.tokens[:, 0] != bridge.tokenizer.bos_token_id).all()
    assert torch.equal(bridge.to_tokens(texts[0])[0], without.tokens[0])
