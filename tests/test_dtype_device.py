"""Precision and place (issue 24): ``load_model(dtype=..., device=...)`` for every kind of model,
float32 analyses whatever the model's dtype, and the loader's safeguards (the bridge's boot check,
GPT-2's constant buffers)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file

from analyses import assign_roles, classify_heads
from interp import UserError, load_model
from interp.bridge import boot_bridge
from interp.convert import from_hf
from interp.random_models import random_hf_model, save_random_model

SHIPPED = ["toy", "interp/toy_variants/alibi", "interp/toy_variants/rotary", "interp/toy_variants/rotary_kv2"]


@pytest.mark.parametrize("bad", ["float64", "bf16", torch.int8, 3])
def test_an_unknown_dtype_is_refused_in_one_line(bad):
    with pytest.raises(UserError, match="allowed: float32, bfloat16, float16") as error:
        load_model("toy", dtype=bad)
    assert repr(bad) in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("bad", ["gpu", "cuda:x"])
def test_an_unknown_device_is_refused_in_one_line(bad):
    with pytest.raises(UserError, match="allowed: cpu, cuda, cuda:N, mps"):
        load_model("toy", device=bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_missing_accelerator_is_refused_in_one_line():
    with pytest.raises(UserError, match="has no cuda device"):
        load_model("toy", device="cuda")


@pytest.mark.parametrize("spec", ["toy", "interp/toy_variants/rotary", "interp/toy_variants/alibi"])
def test_our_checkpoints_load_in_the_dtype_asked_with_float32_positions(spec):
    full, half = load_model(spec), load_model(spec, dtype="bfloat16")
    assert {p.dtype for p in full.parameters()} == {torch.float32}
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    for name, buffer in half.named_buffers():  # rotary frequencies, ALiBi slopes: float32 still
        if name.endswith(("inv_freq", "alibi_slopes")):
            assert buffer.dtype == torch.float32
            torch.testing.assert_close(buffer, dict(full.named_buffers())[name], atol=0, rtol=0)
    for name, param in half.named_parameters():  # the float32 weights, rounded once
        assert torch.equal(param, dict(full.named_parameters())[name].to(torch.bfloat16))
    tokens = full.to_tokens("the cat sat on the mat")
    logits = half(tokens)
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), full(tokens), atol=0.15, rtol=0.05)


@pytest.mark.parametrize("impl", ["scratch", "transformer_lens"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, "float16"])
def test_hugging_face_directories_load_in_the_dtype_asked(tmp_path, impl, dtype):
    save_random_model("llama", tmp_path)
    model = load_model(tmp_path, impl=impl, dtype=dtype)
    want = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
    assert {p.dtype for p in model.parameters()} == {want}
    hf, _ = random_hf_model("llama")  # the same weights (seed 0), run by Hugging Face in that dtype
    tokens = torch.tensor([[1, 40, 41, 42, 43, 44, 45]])
    with torch.no_grad():
        expected = hf.to(want)(tokens).logits.float()
        found = model(tokens).float()
    torch.testing.assert_close(found, expected, atol=0.03, rtol=0.03)


def test_bfloat16_and_float32_give_the_same_roles_on_the_shipped_models():
    """The embedded model and its trained variants: the fixed rule's roles agree; the attention-mass
    scores agree to 0.02 (distance, in tokens, to 2%). Scores come back float (computed in float32)."""
    for spec in SHIPPED:
        full, half = (classify_heads(load_model(spec, dtype=dtype), n_prompts=32, n_boot=200, progress=False)
                      for dtype in ("float32", "bfloat16"))
        assert full[["layer", "head", "measure"]].equals(half[["layer", "head", "measure"]])
        gap = (full["score"] - half["score"]).abs()
        distance = full["measure"] == "distance"
        assert gap[~distance].max() <= 0.02, spec
        assert (gap[distance] <= 0.02 * full["score"][distance].abs()).all(), spec
        assert assign_roles(full)["role"].tolist() == assign_roles(half)["role"].tolist(), spec
        assert (assign_roles(full)["role"] != "").any()  # roles were found, not an empty agreement


def test_from_hf_copies_unless_released():
    hf, tokenizer = random_hf_model("llama")
    kept = from_hf(hf, tokenizer)
    with torch.no_grad():
        hf.model.embed_tokens.weight.zero_()
    assert kept.embed.weight.abs().sum() > 0  # independent of the Hugging Face model
    hf, tokenizer = random_hf_model("llama")
    taken = from_hf(hf, tokenizer, release=True)
    assert taken.embed.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # no copy made


def test_the_bridge_is_refused_where_its_logits_differ_from_hugging_face():
    """TransformerLens 4.3 ignores GPT-2's scale_attn_weights=False (docs/guides/families.md)."""
    hf, tokenizer = random_hf_model("gpt2", scale_attn_weights=False)
    with pytest.raises(UserError, match="computes other logits than Hugging Face"):
        boot_bridge(hf, tokenizer)
    hf, tokenizer = random_hf_model("gpt2")
    assert boot_bridge(hf, tokenizer) is not None


def _with_tensor(directory, name, tensor):
    state = load_file(directory / "model.safetensors")
    state[name] = tensor
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("impl", ["scratch", "transformer_lens"])
def test_gpt2_constant_buffers_in_a_checkpoint_are_accepted(tmp_path, impl):
    save_random_model("gpt2", tmp_path)
    reference = load_model(tmp_path, impl=impl)
    _with_tensor(tmp_path, "transformer.h.0.attn.masked_bias", torch.tensor(-1e4))
    _with_tensor(tmp_path, "transformer.h.1.attn.bias", torch.ones(1, 1, 128, 128, dtype=torch.bool).tril())
    tokens = torch.tensor([[256, 10, 20, 30]])
    torch.testing.assert_close(load_model(tmp_path, impl=impl)(tokens), reference(tokens), atol=0, rtol=0)


def test_any_other_unexpected_tensor_is_still_refused(tmp_path):
    save_random_model("gpt2", tmp_path)
    _with_tensor(tmp_path, "transformer.h.0.attn.extra_bias", torch.zeros(3))
    with pytest.raises(UserError, match="unexpected.*extra_bias"):
        load_model(tmp_path)


def _cli(*argv) -> int:
    from analyses.cli import main

    return main([str(a) for a in argv])


def test_commands_take_dtype_device_and_memory_mb_and_record_them(tmp_path):
    """Every command that loads a model takes the three flags (one shared helper), and meta.json
    records the dtype and device the model ran in."""
    from analyses.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name in ("report", "check", "ablate", "patch", "circuit", "compare", "attention-map", "trace", "task", "explain"):
        options = {o for action in commands[name]._actions for o in action.option_strings}
        assert {"--dtype", "--device", "--memory-mb"} <= options, name
    assert _cli("ablate", "--dtype", "bfloat16", "--memory-mb", "8", "--prompts", "4", "--heads", "0.1",
                "--method", "zero", "--out", tmp_path / "ablate", "--quiet") == 0
    meta = json.loads((tmp_path / "ablate" / "meta.json").read_text())
    assert meta["dtype"] == "bfloat16" and meta["device"] == "cpu"
    frame = pd.read_csv(tmp_path / "ablate" / "ablation.csv")
    numbers = frame.drop(columns="position").select_dtypes("number")  # position: blank, the head at every position
    assert frame["position"].isna().all() and numbers.notna().all().all() and len(frame) > 0


def test_a_bad_dtype_flag_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        _cli("check", "--dtype", "float64")
    assert "invalid choice: 'float64'" in capsys.readouterr().err


def test_a_study_spec_takes_dtype_device_and_memory_mb():
    from analyses.studies.spec import parse_study

    study = parse_study({"model": {"spec": "toy", "dtype": "bfloat16", "device": "cpu"}, "run": {"memory_mb": 64},
                         "ablation": {"method": "zero"}})
    assert study.cells[0].spec.dtype == "bfloat16" and study.device == "cpu" and study.memory_mb == 64
    assert "device" not in study.record()  # where it runs is not what it is
    with pytest.raises(UserError, match=r"\[model\].dtype is 'half'; allowed: float32, bfloat16, float16"):
        parse_study({"model": {"dtype": "half"}, "ablation": {"method": "zero"}})
    with pytest.raises(UserError, match=r"\[run\].memory_mb must be a number above 0"):
        parse_study({"run": {"memory_mb": 0}, "ablation": {"method": "zero"}})


def test_a_bfloat16_model_gives_float32_metrics_patching_and_edge_scores_close_to_float32():
    """Metrics, activation patching, attribution and EAP on the bfloat16 toy: float32 results within
    bfloat16's rounding of the float32 model's (the sums are float32, so they do not drift)."""
    from analyses.circuits.path_patching import edge_attribution
    from analyses.interventions.attribution import attribution_patch_heads
    from analyses.core.metrics import logit_diff_metric, loss_metric
    from analyses.interventions.patching import patch_heads
    from analyses.core.probes import corrupt_first_copy, probes_for

    full, half = load_model("toy"), load_model("toy", dtype="bfloat16")
    probes = probes_for(full, 8, 32, seed=0)
    clean, corrupted = probes.tokens, corrupt_first_copy(probes, seed=1)
    metric = loss_metric(clean, probes.predictable)
    with torch.no_grad():
        loss = metric(half(clean))
        diff = logit_diff_metric(10, 20)(half(clean))
    assert loss.dtype == torch.float32 and diff.dtype == torch.float32
    torch.testing.assert_close(loss, metric(full(clean)), atol=0.05, rtol=0.02)
    results = {}
    for name, model in (("full", full), ("half", half)):
        results[name] = (patch_heads(model, clean, corrupted, metric, progress=False),
                         attribution_patch_heads(model, clean, corrupted, metric),
                         torch.tensor(edge_attribution(model, clean, corrupted, metric)["attribution"].to_numpy()))
    for exact, approx in zip(results["full"], results["half"]):
        exact, approx = torch.as_tensor(exact).float(), torch.as_tensor(approx)
        assert approx.dtype in (torch.float32, torch.float64)
        assert (approx - exact).abs().max() <= 0.05 * exact.abs().max(), (approx - exact).abs().max()


def test_direct_logit_attribution_reads_a_bfloat16_final_norm():
    """The final RMS norm of a bfloat16 Llama-width model is recognised (its output is rounded to
    bfloat16, so the affine fit is allowed that rounding); a non-norm is still refused."""
    from analyses.components.decompose import final_norm
    from interp import GPTConfig, GPTModel

    torch.manual_seed(0)
    cfg = GPTConfig(d_vocab=512, n_ctx=32, d_model=2048, n_heads=32, n_layers=1, n_key_value_heads=8, d_mlp=512,
                    normalization_type="RMS", act_fn="silu", gated_mlp=True, positional_embedding_type="rotary",
                    qkv_bias=False, attn_out_bias=False, mlp_bias=False)
    model = GPTModel(cfg).to(torch.bfloat16).eval()
    _, cache = model.run_with_cache(torch.randint(0, 512, (4, 32)))
    final = cache["blocks.0.hook_resid_post"]
    norm = final_norm(model, final)
    assert norm.scale.dtype == torch.float32
    model.ln_final = torch.nn.Tanh()
    with pytest.raises(UserError, match="the final norm is not"):
        final_norm(model, final)
