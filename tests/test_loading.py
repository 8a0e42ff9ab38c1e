"""load_model: local GPT-2 directories with both impls, our safetensors checkpoints, hub names
offline, and the refusals. No network: the hub is declared unreachable."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2LMHeadModel

import interp.hub
from interp import GPTConfig, GPTModel, load_model, provenance
from interp.errors import UserError
from interp.loading import load_checkpoint, save_checkpoint
from interp.random_models import FAMILIES, random_hf_model


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@torch.no_grad()
def test_a_saved_gpt2_directory_loads_with_both_impls_to_equal_logits(gpt2_dir):
    scratch = load_model(gpt2_dir, impl="scratch")
    bridge = load_model(gpt2_dir, impl="transformer_lens")
    hf = GPT2LMHeadModel.from_pretrained(gpt2_dir, attn_implementation="eager").eval()
    assert isinstance(scratch, GPTModel)
    tokens = scratch.to_tokens("induction heads copy")
    assert torch.equal(tokens, bridge.to_tokens("induction heads copy"))
    torch.testing.assert_close(scratch(tokens), hf(tokens).logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(scratch(tokens), bridge(tokens), atol=1e-4, rtol=0)


def test_a_gpt2_directory_without_tokenizer_still_loads_as_scratch(tmp_path, hf_gpt2):
    hf_gpt2[0].save_pretrained(tmp_path)
    model = load_model(tmp_path)
    tokens = torch.arange(10)[None]
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf_gpt2[0](tokens).logits, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        load_model(tmp_path, impl="transformer_lens")


@pytest.mark.parametrize("impl", [None, "scratch"])
def test_a_directory_without_tokenizer_whose_vocabulary_is_not_bytes_is_refused(tmp_path, impl):
    """Read with the byte tokenizer, a 320-token Llama's text and start token (``<s>`` at 1, not
    256) would silently be other tokens: refused in one line before any weight is read."""
    random_hf_model("llama", d_vocab=320)[0].save_pretrained(tmp_path)
    with pytest.raises(UserError, match=rf"^'{tmp_path}' has no tokenizer files \(none of tokenizer.json, .*\) and "
                                        r"its 320-token vocabulary is not the byte tokenizer's \(257\)") as error:
        load_model(tmp_path, impl=impl)
    assert "\n" not in str(error.value)
    random_hf_model("llama", d_vocab=320)[1].save_pretrained(tmp_path)  # with its tokenizer it loads
    assert load_model(tmp_path, impl=impl).tokenizer.bos_token_id == 1


def test_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(d_vocab=257, n_ctx=32, d_model=32, n_heads=4, n_layers=2, attn_only=True)).eval()
    save_checkpoint(model, tmp_path / "ckpt", training={"steps": 3})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors", "training.json"]
    loaded = load_model(tmp_path / "ckpt")
    assert loaded.cfg == model.cfg
    tokens = model.to_tokens("hello there")
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))
    assert json.loads((tmp_path / "ckpt" / "training.json").read_text()) == {"steps": 3}


def test_non_finite_weights_are_refused(tmp_path):
    model = GPTModel(GPTConfig(d_vocab=257, n_ctx=8, d_model=16, n_heads=2, n_layers=1))
    with torch.no_grad():
        model.blocks[0].attn.W_key.weight[0, 0] = float("nan")
    save_checkpoint(model, tmp_path)
    with pytest.raises(ValueError, match="blocks.0.attn.W_key.weight.*non-finite"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("name", ["model.pt", "weights.bin", "x.pkl"])
def test_pickle_checkpoints_are_refused(tmp_path, name):
    (tmp_path / name).write_bytes(b"not even looked at")
    with pytest.raises(ValueError, match="refusing to load .*pickle"):
        load_model(tmp_path / name)


@pytest.mark.parametrize("hub_id", ["gpt2", "EleutherAI/pythia-70m", "openai-community/gpt2"])
def test_a_hub_id_offline_fails_at_once_with_a_way_out(monkeypatch, hub_id):
    """Not cached, hub unreachable: one TCP probe, then the error (no retry loop), for plain and
    org/name ids alike (an org/name id used to be refused as 'not a directory')."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    probes = []

    def unreachable(*args, **kwargs):
        probes.append(args)
        raise OSError("network is unreachable")

    monkeypatch.setattr(interp.hub.socket, "create_connection", unreachable)
    monkeypatch.setenv("HF_HOME", str(interp.hub.Path("/nonexistent-hf-home")))
    with pytest.raises(interp.hub.OfflineError, match=f"'{hub_id}'.*cannot be reached.*save_pretrained"):
        load_model(hub_id)
    assert len(probes) == 1


def test_hub_probe_is_skipped_when_offline_is_declared(monkeypatch):
    monkeypatch.setattr(interp.hub.socket, "create_connection", lambda *a, **k: pytest.fail("probed the network"))
    assert interp.hub.hub_reachable() is False


@pytest.mark.parametrize(
    "spec, impl, error, message",
    [
        ("toy", "keras", UserError, "unknown impl 'keras'; allowed: scratch, transformer_lens"),
        ("./no/such/dir", "scratch", UserError, r"no such directory './no/such/dir' \(.* does not exist\), and it is no hub id"),
    ],
)
def test_bad_specs_get_a_clear_error(spec, impl, error, message):
    with pytest.raises(error, match=message):
        load_model(spec, impl=impl)


def test_a_directory_without_config_is_named(tmp_path):
    with pytest.raises(UserError, match="has no config.json"):
        load_model(tmp_path)


def test_our_checkpoint_cannot_be_bridged(tmp_path):
    save_checkpoint(GPTModel(GPTConfig(d_vocab=257, n_ctx=8, d_model=16, n_heads=2, n_layers=1)), tmp_path)
    with pytest.raises(ValueError, match="only impl='scratch'"):
        load_model(tmp_path, impl="transformer_lens")


# the families GPTModel implements; the bridge runs the rest
EXPECTED_IMPL = {family: "scratch" for family in ("gpt2", "llama", "mistral", "qwen2", "gemma", "gemma2", "gemma3_text",
                                                  "gpt_neox", "phi")}


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_every_family_loads_by_its_model_type_with_logits_equal_to_hf(family_dir, family):
    directory = family_dir(family)
    model = load_model(directory)
    record = provenance(model)
    assert (record["family"], record["impl"]) == (family, EXPECTED_IMPL.get(family, "transformer_lens"))
    hf = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    tokens = torch.tensor([[5, 70, 71, 72, 90, 91, 100]])
    torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-4, rtol=0)


def test_scratch_refuses_a_family_it_does_not_implement_in_one_line(family_dir):
    with pytest.raises(UserError, match=r"^impl='scratch' does not implement the 'opt' family \(it implements: gpt2, "
                                        r"llama, mistral, qwen2, gemma, gemma2, gemma3_text, gpt_neox, phi, bloom\)"):
        load_model(family_dir("opt"), impl="scratch")


def _edit_safetensors(directory, edit):
    path = directory / "model.safetensors"
    state = load_file(path)
    edit(state)
    save_file(state, path, metadata={"format": "pt"})


@pytest.mark.parametrize("family, impl", [("gpt2", "scratch"), ("gpt2", "transformer_lens"), ("llama", None)])
@pytest.mark.parametrize("problem", ["missing", "unexpected", "mis-shaped"])
def test_a_checkpoint_tensor_that_does_not_fit_is_an_error_not_a_reinitialisation(tmp_path, family_dir, family, impl,
                                                                                     problem):
    directory = shutil.copytree(family_dir(family), tmp_path / family)
    victim = sorted(load_file(directory / "model.safetensors"))[-1]
    edits = {
        "missing": lambda state: state.pop(victim),
        "unexpected": lambda state: state.__setitem__("extra.weight", torch.zeros(3)),
        "mis-shaped": lambda state: state.__setitem__(victim, torch.zeros(3)),
    }
    _edit_safetensors(directory, edits[problem])
    with pytest.raises(UserError, match="does not match|wrong shape"):
        load_model(directory, impl=impl)


@pytest.mark.parametrize("problem", ["missing", "unexpected", "mis-shaped"])
def test_our_checkpoint_with_a_tensor_that_does_not_fit_is_refused(tmp_path, problem):
    save_checkpoint(GPTModel(GPTConfig(d_vocab=257, n_ctx=8, d_model=16, n_heads=2, n_layers=1)), tmp_path)
    edits = {
        "missing": lambda state: state.pop("ln_final.bias"),
        "unexpected": lambda state: state.__setitem__("extra.weight", torch.zeros(3)),
        "mis-shaped": lambda state: state.__setitem__("ln_final.bias", torch.zeros(3)),
    }
    _edit_safetensors(tmp_path, edits[problem])
    with pytest.raises(UserError, match=f"{problem}.*refusing to analyse re-initialised weights"):
        load_model(tmp_path)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f in EXPECTED_IMPL])
def test_to_tokens_follows_the_familys_convention_as_the_bridge_does(family_dir, family):
    """TransformerLens prepends no start token by default on qwen2, gpt_neox and phi; our
    to_tokens follows the same per-family default, so TL-convention tools see the same tokens."""
    scratch = load_model(family_dir(family), impl="scratch")
    bridge = load_model(family_dir(family), impl="transformer_lens")
    for text in ("hello world", "a"):
        assert torch.equal(scratch.to_tokens(text), bridge.to_tokens(text))
        assert torch.equal(scratch.to_tokens(text, prepend_bos=True), bridge.to_tokens(text, prepend_bos=True))


@pytest.mark.parametrize("device_map", [{"": "cpu"}, "auto"])
@torch.no_grad()
def test_a_device_map_reaches_transformers_and_the_bridge_runs_the_model_where_it_lies(monkeypatch, gpt2_dir,
                                                                                       device_map):
    """On the CPU (the only device here) every map places everything on it: what can be checked is
    that the map is what transformers loads with, that the bridge wraps that very model (no copy,
    which would undo a multi-device placement and double the memory), and equal logits."""
    loaded = []
    from_pretrained = AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        model, info = from_pretrained(*args, **kwargs)
        loaded.append((kwargs.get("device_map"), model))
        return model, info

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    bridge = load_model(gpt2_dir, device_map=device_map)  # impl=None: the bridge, the one impl that takes a map
    [(passed, hf_model)] = loaded
    assert passed == device_map and bridge.original_model is hf_model
    reference = load_model(gpt2_dir, impl="transformer_lens")
    tokens = reference.to_tokens("heads spread over devices")
    torch.testing.assert_close(bridge(tokens), reference(tokens), atol=1e-4, rtol=0)
    assert provenance(bridge) == provenance(reference)


@pytest.mark.parametrize("spec, options, message", [
    ("gpt2_dir", dict(impl="scratch", device_map="auto"), "the from-scratch model .* runs on one device"),
    ("toy", dict(device_map="auto"), "'toy' is a from-scratch checkpoint, which runs on one device"),
    ("gpt2_dir", dict(device_map="auto", device="cpu"), "pass device .* or device_map .*, not both"),
    ("gpt2_dir", dict(device_map="everywhere"), "device_map 'everywhere': allowed: auto, balanced"),
    ("gpt2_dir", dict(device_map={}), "device_map {}: allowed"),
])
def test_a_device_map_that_cannot_be_honoured_is_one_line(gpt2_dir, spec, options, message):
    with pytest.raises(UserError, match=message) as error:
        load_model(gpt2_dir if spec == "gpt2_dir" else spec, **options)
    assert "\n" not in str(error.value)


def test_shipped_checkpoints_load_by_name_from_any_directory(tmp_path, monkeypatch):
    """``toy@200`` is the toy model's shipped step-200 checkpoint wherever the command runs (the
    README's ``interp compare toy@200 toy`` worked only from the repository root as a path); a step
    that was not shipped is refused in one line naming the ones that were."""
    from interp.loading import embedded_checkpoints
    from safetensors.torch import load_file

    monkeypatch.chdir(tmp_path)
    model = load_model("toy@200")
    stored = load_file(str(embedded_checkpoints("toy")[200] / "model.safetensors"))
    ours = model.state_dict()
    assert stored and all(torch.equal(ours[name], tensor) for name, tensor in stored.items())
    final = load_model("toy").state_dict()["blocks.1.attn.W_query.weight"]
    assert not torch.equal(ours["blocks.1.attn.W_query.weight"], final)
    with pytest.raises(UserError, match=r"^'toy@199': toy ships checkpoints at steps 200 \(e.g. toy@200\)$"):
        load_model("toy@199")
    assert load_model("code@1000").cfg.n_layers == 2
