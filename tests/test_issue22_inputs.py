"""Issue 22, items 4-6: a scripted cumulative study prunes in the order of ``interp ablate``
(``preserve_patterns`` included); metrics on texts of unequal lengths read each prompt's own
tokens, never the padding, and a position past the end is refused, never wrapped; bad input
(configs, checkpoints, missing directories, too few prompts, models that cannot be compared) gets
a one-line error from the command line, before any work."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from analyses.core.execution import executing
from analyses.interventions.ablation import ablate_heads, head_importance, prepare_ablation, pruning_curve
from analyses.cli import main
from analyses.core.metrics import as_metric, logit_diff_metric, loss_metric
from analyses.core.probes import probes_for
from analyses.studies.runner import run_study
from analyses.studies.spec import load_spec
from analyses.core.tokens import encode
from interp import UserError, load_model
from interp.loading import save_checkpoint
from interp.random_models import save_random_model

TEXTS = ["the cat sat on the mat", "a dog", "birds fly south"]  # 23, 6 and 16 tokens with the start token


def naive_logits(model, text: str, heads: list[tuple[int, int]]) -> torch.Tensor:
    """Logits (pos, d_vocab) of ``text`` run alone (no padding), ``heads`` zeroed at hook_z."""
    def zero(z, hook):  # z: (batch, pos, head, d_head)
        layer = int(hook.name.split(".")[1])
        z[:, :, [h for l, h in heads if l == layer]] = 0.0
        return z

    hooks = [(f"blocks.{l}.attn.hook_z", zero) for l in sorted({l for l, _ in heads})]
    with torch.no_grad():
        return model.run_with_hooks(model.to_tokens(text), fwd_hooks=hooks)[0]


# ---- item 4: a cumulative study prunes in interp ablate's order ---------------------------------------------


def test_cumulative_study_with_preserve_patterns_prunes_in_the_order_of_interp_ablate(tmp_path):
    """On the trained toy model, where frozen patterns change which head matters least."""
    spec = tmp_path / "spec.toml"
    spec.write_text('[model]\nspec = "toy"\n'
                    '[prompts]\nkind = "repeated"\nn = 6\nseed = 3\nseq_len = 24\n'
                    '[ablation]\nmethod = "mean"\ntargets = "cumulative"\npreserve_patterns = true\nseed = 3\n'
                    '[metric]\nkind = "repeat_loss"\n')
    study = pd.read_csv(run_study(spec, tmp_path / "study", progress=False))
    argv = ["ablate", "--model", "toy", "--prompts", "6", "--seq-len", "24",
            "--seed", "3", "--method", "mean", "--targets", "cumulative", "--preserve-patterns",
            "--out", str(tmp_path / "ablate"), "--quiet"]
    assert main(argv) == 0
    ablate = pd.read_csv(tmp_path / "ablate" / "ablation.csv", dtype={"layer": "Int64", "head": "Int64"})
    pruned = ["none"] + [f"prune:L{l}H{h}" for l, h in zip(ablate["layer"][1:], ablate["head"][1:])]
    assert list(study["target"]) == pruned
    torch.testing.assert_close(torch.tensor(study["metric"].to_numpy()), torch.tensor(ablate["metric"].to_numpy()),
                               atol=1e-5, rtol=0)
    # not vacuous: without preserve_patterns the order differs from the first step
    model = load_model("toy").eval()
    probes = probes_for(model, 6, 24, seed=3)
    free = pruning_curve(model, probes, "mean", loss_metric(probes.tokens, probes.predictable), seed=3, progress=False)
    assert (free["layer"][1], free["head"][1]) != (ablate["layer"][1], ablate["head"][1])


# ---- item 5: texts of unequal lengths, positions ---------------------------------------------------------------


@pytest.mark.parametrize("backend", ["scratch_gpt2", "bridge_gpt2"])
@pytest.mark.parametrize("heads", [[], [(0, 1), (1, 3)]])
def test_logit_diff_on_ragged_texts_equals_each_text_run_alone(request, backend, heads):
    """Each prompt is read at its own last real token: the batch's value is the mean of each text's
    value run alone (no padding), zero-ablated by hand. On GPTModel the ablated runs unembed only
    the positions read (read_positions), one per distinct length."""
    model = request.getfixturevalue(backend)
    correct, incorrect = ord("a"), ord("b")
    metric = logit_diff_metric(correct, incorrect)
    alone = [naive_logits(model, text, heads)[-1] for text in TEXTS]
    expected = torch.stack([logits[correct] - logits[incorrect] for logits in alone]).mean()
    assert len(set(encode(model, TEXTS).lengths.tolist())) == len(TEXTS)  # really ragged
    ablation = prepare_ablation(model, TEXTS, "zero", metric)
    seen = []  # on GPTModel: how many positions each ablated run unembeds (ln_final's input)
    handle = model.ln_final.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1])) \
        if backend == "scratch_gpt2" else None
    with executing(progress=False):
        value = ablation.run([heads])[0].item() if heads else ablation.baseline
    if handle is not None:
        handle.remove()
        assert seen == ([len(TEXTS)] if heads else [])  # one position per distinct length, each prompt's last
    assert value == pytest.approx(expected.item(), abs=1e-4)


def test_loss_metric_on_ragged_texts_counts_real_tokens_only(scratch_gpt2):
    """A loss built on the padded tokens without a mask still counts each text's real tokens only
    when an ablation runs it on texts: the cross-entropy of each text run alone, pooled."""
    batch = encode(scratch_gpt2, TEXTS)
    losses = [F.cross_entropy(naive_logits(scratch_gpt2, text, [(1, 0)])[:-1], scratch_gpt2.to_tokens(text)[0, 1:],
                              reduction="none") for text in TEXTS]
    value = ablate_heads(scratch_gpt2, TEXTS, [(1, 0)], "zero", loss_metric(batch.tokens))
    assert value == pytest.approx(torch.cat(losses).mean().item(), abs=1e-5)


def test_a_metric_of_some_prompts_reads_only_their_positions_and_splits_again():
    """``Metric.rows``: the loss (and logit difference) of the first prompts as a metric of its own:
    by hand on those prompts' logits, declaring only the positions those prompts count (the report's
    interventions unembed just these), and splitting over prompts again, its weighted parts its value."""
    torch.manual_seed(3)
    tokens, logits = torch.randint(0, 10, (4, 6)), torch.randn(4, 6, 10)
    counted = torch.zeros(4, 6, dtype=torch.bool)
    counted[0, 2], counted[1, 3], counted[1, 4], counted[3, 5] = True, True, True, True  # prompt 3 is left out
    first = loss_metric(tokens, counted).rows(slice(0, 2))
    by_hand = torch.cat([F.cross_entropy(logits[0, 1:2], tokens[0, 2:3], reduction="none"),
                         F.cross_entropy(logits[1, 2:4], tokens[1, 3:5], reduction="none")]).mean()
    torch.testing.assert_close(first(logits[:2]), by_hand)
    read = first.positions(6)
    assert read.tolist() == [1, 2, 3]  # not 4, which only prompt 3 reads
    parts = [first.part(rows, read) for rows in (slice(0, 1), slice(1, 2))]
    pooled = sum(weight * part(logits[rows][:, read]) for (part, weight), rows in zip(parts, (slice(0, 1), slice(1, 2))))
    torch.testing.assert_close(pooled / sum(weight for _, weight in parts), by_hand)
    diff = logit_diff_metric(torch.tensor([1, 2, 3, 4]), 0, lengths=torch.tensor([6, 4, 5, 6])).rows(slice(1, 3))
    torch.testing.assert_close(diff(logits[1:3]), ((logits[1, 3, 2] - logits[1, 3, 0]) + (logits[2, 4, 3] - logits[2, 4, 0])) / 2)
    plain = as_metric(lambda logits: logits.mean())
    assert not plain.restricts
    with pytest.raises(UserError, match="cannot be restricted to prompts 0:1"):
        plain.rows(slice(0, 1))


def test_a_loss_part_names_the_entries_it_counts_and_takes_their_logits_alone():
    """A part of the loss at read positions says which (prompt, position) entries it counts
    (``entries``) and takes the logits of those alone, row-major, with the value it has on the
    whole positions' logits (by hand: cross-entropy of the counted tokens); other lengths refused."""
    torch.manual_seed(4)
    tokens, logits = torch.randint(0, 10, (3, 6)), torch.randn(3, 6, 10)
    counted = torch.zeros(3, 6, dtype=torch.bool)
    counted[0, 2], counted[1, 4], counted[1, 5], counted[2, 3] = True, True, True, True
    metric = loss_metric(tokens, counted)
    read = metric.positions(6)
    assert read.tolist() == [1, 2, 3, 4]
    part, weight = metric.part(slice(0, 2), read)
    assert weight == 3 and part.entries.tolist() == [[True, False, False, False], [False, False, True, True]]
    by_hand = F.cross_entropy(torch.stack([logits[0, 1], logits[1, 3], logits[1, 4]]), torch.tensor(
        [tokens[0, 2], tokens[1, 4], tokens[1, 5]]))
    at_read = logits[:2][:, read]  # (rows, n, d_vocab)
    torch.testing.assert_close(part(at_read), by_hand)
    torch.testing.assert_close(part(at_read[part.entries]), by_hand)  # (3, d_vocab)
    with pytest.raises(UserError, match=r"reads 3 entries, but got logits of shape \(2, 10\)"):
        part(at_read[part.entries][:2])
    assert metric.part(slice(0, 2), None)[0].entries is None  # every position: no entries


def test_a_ragged_batch_with_a_fixed_position_metric_of_unknown_make_is_refused(scratch_gpt2):
    metric = lambda logits: logits[:, -1, 0].mean()  # noqa: E731
    metric.read_positions = -1
    with pytest.raises(UserError, match=r"fixed positions \(\[-1\]\).*unequal token lengths"):
        prepare_ablation(scratch_gpt2, TEXTS, "zero", metric)


def test_positions_past_the_end_are_refused_not_wrapped():
    logits = torch.randn(2, 6, 10)
    with pytest.raises(UserError, match=r"^the metric reads position 6, but these prompts have 6 tokens \(allowed -6 "
                                        r"\.\. 5\): it was built for other, longer prompts; build it from the prompts you "
                                        r"pass$"):
        logit_diff_metric(1, 2, position=6).positions(6)
    with pytest.raises(UserError, match="position -7 is past the end"):
        logit_diff_metric(1, 2, position=-7)(logits)
    with pytest.raises(UserError, match="position 3 is past the end of prompt 1, which has 2 real tokens"):
        logit_diff_metric(1, 2, position=3, lengths=torch.tensor([6, 2]))
    # with lengths, -1 is each prompt's last real token; the positions read are declared per prompt
    bound = logit_diff_metric(1, 2, lengths=torch.tensor([6, 2]))
    expected = ((logits[0, 5, 1] - logits[0, 5, 2]) + (logits[1, 1, 1] - logits[1, 1, 2])) / 2
    torch.testing.assert_close(bound(logits), expected)
    assert bound.positions(6).tolist() == [1, 5]
    with pytest.raises(UserError, match="logits of shape"):
        bound(torch.randn(3, 6, 10))  # three prompts, two lengths
    with pytest.raises(UserError, match="outside the vocabulary"):
        logit_diff_metric(1, 12)(logits)
    tokens = torch.zeros(2, 6, dtype=torch.long)
    with pytest.raises(UserError, match=r"logits of shape \(2, 5, 10\)"):
        loss_metric(tokens)(logits[:, :5])  # logits of other tokens
    with pytest.raises(UserError, match="loss positions have shape"):
        loss_metric(tokens, torch.ones(2, 5, dtype=torch.bool))


# ---- item 6: bad input, one line from the command line ---------------------------------------------------------


def refused(argv, capsys) -> str:
    """Run the command line; it must refuse with exit status 2 and one line on stderr -> that line."""
    capsys.readouterr()  # drop what the test's own setup printed
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture
def toy_checkpoint(tmp_path):
    return save_checkpoint(load_model("toy"), tmp_path / "ours")


def test_a_config_json_that_is_not_json_is_refused(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{not json")
    line = refused(["ablate", "--model", str(tmp_path / "m"), "--out", str(tmp_path / "o")], capsys)
    assert "config.json is not JSON (Expecting property name enclosed in double quotes at line 1 column 2)" in line


def test_a_config_json_naming_no_model_type_is_refused(tmp_path, gpt2_dir, capsys):
    model_dir = shutil.copytree(gpt2_dir, tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    del config["model_type"]
    (model_dir / "config.json").write_text(json.dumps(config))
    line = refused(["ablate", "--model", str(model_dir), "--out", str(tmp_path / "o")], capsys)
    assert "config.json names no model_type" in line


def test_our_checkpoint_without_its_weights_is_refused(tmp_path, toy_checkpoint, capsys):
    (toy_checkpoint / "model.safetensors").unlink()
    line = refused(["ablate", "--model", str(toy_checkpoint), "--out", str(tmp_path / "o")], capsys)
    assert line.endswith("is a checkpoint of ours (config.json format 'interp-gpt/1') but has no model.safetensors")


def test_broken_checkpoints_of_ours_are_refused(tmp_path, toy_checkpoint, capsys):
    weights = (toy_checkpoint / "model.safetensors").read_bytes()
    (toy_checkpoint / "model.safetensors").write_bytes(b"not safetensors")
    line = refused(["ablate", "--model", str(toy_checkpoint), "--out", str(tmp_path / "o")], capsys)
    assert "model.safetensors is not a readable safetensors file" in line
    (toy_checkpoint / "model.safetensors").write_bytes(weights)  # one fault at a time: now the config
    config = json.loads((toy_checkpoint / "config.json").read_text())
    del config["config"]["n_layers"]
    (toy_checkpoint / "config.json").write_text(json.dumps(config))
    line = refused(["ablate", "--model", str(toy_checkpoint), "--out", str(tmp_path / "o")], capsys)
    assert "GPTConfig fields ['n_layers'] are missing" in line


def test_hugging_face_directories_without_weights_or_of_an_unknown_type_are_refused(tmp_path, gpt2_dir, capsys):
    no_weights = shutil.copytree(gpt2_dir, tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    line = refused(["ablate", "--model", str(no_weights), "--out", str(tmp_path / "o")], capsys)
    assert f"could not read the weights of '{no_weights}'" in line
    unknown = shutil.copytree(gpt2_dir, tmp_path / "unknown")
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps(config | {"model_type": "no-such-family"}))
    line = refused(["ablate", "--model", str(unknown), "--out", str(tmp_path / "o")], capsys)
    assert f"could not read the config of '{unknown}'" in line and "no-such-family" in line


def test_a_missing_relative_directory_that_looks_like_a_hub_id_says_both(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    line = refused(["ablate", "--model", "models/foo", "--out", "o"], capsys)
    assert f"no such directory 'models/foo' ({tmp_path / 'models/foo'} does not exist), and as a hub id" in line
    assert "cannot be fetched" in line


@pytest.fixture
def no_model_load(monkeypatch):
    """Every command's model loading fails the test: a refusal must come before it."""
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    for module in ("analyses.cli.report", "analyses.cli.compare", "analyses.cli.circuit", "analyses.cli.interventions"):
        monkeypatch.setattr(f"{module}.load_cli_model", no_model)


@pytest.mark.parametrize("command", [["report"], ["compare", "toy", "toy"], ["circuit"], ["ablate"], ["patch"]])
def test_probes_too_short_are_refused_before_the_model_loads(tmp_path, no_model_load, capsys, command):
    with pytest.raises(SystemExit):  # by the parser
        main([*command, "--seq-len", "5", "--out", str(tmp_path / "o")])
    assert capsys.readouterr().err.splitlines()[-1].endswith("argument --seq-len: 5 is not a whole number >= 8")


def test_a_study_of_too_short_probes_is_refused_at_parse(tmp_path):
    spec = tmp_path / "spec.toml"
    spec.write_text('[prompts]\nseq_len = 5\n[ablation]\nmethod = "zero"\n')
    with pytest.raises(UserError, match=r"\[prompts\].seq_len must be >= 8 .*got 5"):
        load_spec(spec)


@pytest.mark.parametrize("argv", [
    ["report", "--prompts", "1"],
    ["compare", "toy", "toy", "--prompts", "1"],
    ["circuit", "--prompts", "1", "--out", "{out}"],
    ["ablate", "--prompts", "1", "--out", "{out}"],
    ["ablate", "--prompts", "1", "--method", "resample", "--out", "{out}"],
])
def test_one_prompt_is_refused_at_once_saying_why_two(tmp_path, no_model_load, capsys, argv):
    line = refused([arg.format(out=tmp_path / "o") for arg in argv], capsys)
    assert "--prompts 1: at least 2 prompts are needed, since" in line
    assert ("degrees of freedom" in line) or ("other prompts" in line) or ("another prompt" in line)


def test_a_study_of_one_prompt_with_mean_ablation_is_refused(tmp_path):
    spec = tmp_path / "spec.toml"
    spec.write_text('[prompts]\nn = 1\n[ablation]\nmethod = "mean"\n')
    with pytest.raises(UserError, match=r"\[prompts\].n is 1, but at least 2 prompts are needed, since mean ablation"):
        run_study(spec, tmp_path / "out", progress=False)


def test_compare_refuses_models_with_other_tokens_or_a_shorter_context(tmp_path, capsys):
    gpt2 = save_random_model("gpt2", tmp_path / "gpt2", d_vocab=320, n_ctx=64)
    neox = save_random_model("gpt_neox", tmp_path / "neox", d_vocab=320, n_ctx=64)  # same shape, other tokens
    short = save_random_model("gpt2", tmp_path / "short", d_vocab=320, n_ctx=32, seed=1)
    line = refused(["compare", str(gpt2), str(neox), "--prompts", "2", "--out", str(tmp_path / "o")], capsys)
    assert "the models differ in their tokens (start token 256 vs 0; tokenizer size 257 vs 258)" in line
    other_start = shutil.copytree(gpt2, tmp_path / "other_start")  # the same weights and tokens, another BOS
    config = json.loads((other_start / "tokenizer_config.json").read_text())
    (other_start / "tokenizer_config.json").write_text(json.dumps(config | {"bos_token": "!"}))
    line = refused(["compare", str(gpt2), str(other_start), "--prompts", "2", "--out", str(tmp_path / "o")], capsys)
    assert "the models differ in their tokens (start token 256 vs 0)" in line
    line = refused(["compare", str(gpt2), str(short), "--prompts", "2", "--out", str(tmp_path / "o")], capsys)
    assert "the probes are 64 tokens" in line and "model B reads at most n_ctx=32" in line


def test_text_files_that_are_not_utf8_are_refused(tmp_path, capsys):
    texts = tmp_path / "texts.txt"
    texts.write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    line = refused(["report", "--text-file", str(texts), "--out", str(tmp_path / "o")], capsys)
    assert line.endswith(f"text file {str(texts)!r} is not UTF-8 text (invalid continuation byte at byte 3)")
    spec = tmp_path / "spec.toml"
    spec.write_text('[prompts]\nkind = "text"\nfile = "texts.txt"\n[ablation]\nmethod = "zero"\n')
    with pytest.raises(UserError, match=r"\[prompts\].file '.*texts.txt' is not UTF-8 text"):
        run_study(spec, tmp_path / "out", progress=False)


def test_a_resumed_study_whose_model_record_is_not_json_is_refused(tmp_path):
    spec = tmp_path / "spec.toml"
    spec.write_text('[prompts]\nn = 2\nseq_len = 16\n[ablation]\nmethod = "zero"\ntargets = "each_layer"\n')
    run_study(spec, tmp_path / "out", progress=False)
    (tmp_path / "out" / "provenance.json").write_text("{torn")
    with pytest.raises(UserError, match=r"provenance.json is not the JSON record this study writes; use a new --out"):
        run_study(spec, tmp_path / "out", resume=True, progress=False)


def test_head_importance_takes_preserve_patterns_and_gives_the_pruning_curve_order():
    """head_importance passed on its own (then to pruning_curve(order=...)) must rank heads as the
    pattern-preserving pruning curve does, which it could not before (it had no preserve_patterns)."""
    from analyses.interventions.ablation import pruning_order  # new with this change: the module imports on older code

    model = load_model("toy").eval()
    probes = probes_for(model, 6, 24, seed=3)
    metric = loss_metric(probes.tokens, probes.predictable)
    importance = head_importance(model, probes, "mean", metric, preserve_patterns=True, seed=3)
    curve = pruning_curve(model, probes, "mean", metric, preserve_patterns=True, seed=3, progress=False)
    assert [(l, h) for l, h in zip(curve["layer"][1:], curve["head"][1:])] == pruning_order(importance)
    free = head_importance(model, probes, "mean", metric, seed=3)
    assert pruning_order(free)[0] != pruning_order(importance)[0]  # the option changes the order here


def test_scores_over_training_refuses_a_checkpoint_with_a_shorter_context():
    from analyses.report.compare import scores_over_training
    from interp import GPTConfig, GPTModel

    models = [GPTModel(GPTConfig(d_vocab=257, n_ctx=n_ctx, d_model=32, n_heads=2, n_layers=1)).eval() for n_ctx in (64, 32)]
    with pytest.raises(UserError, match="the probes are 64 tokens .* but the model of step 10 reads at most n_ctx=32"):
        scores_over_training(models, [0, 10], n_prompts=2, progress=False)


def test_a_hub_id_the_hub_does_not_serve_is_refused_saying_it_is_no_directory(tmp_path, monkeypatch, capsys):
    """The hub answers, but the id names nothing it serves (here: offline mode is declared, so
    transformers refuses without a request, as it would for an unknown repository)."""
    import interp.hub

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(interp.hub, "hub_reachable", lambda timeout=3.0: True)
    line = refused(["ablate", "--model", "no-such-org/no-such-model", "--out", "o"], capsys)
    assert "no such directory 'no-such-org/no-such-model', and as a hub id could not read the config" in line
