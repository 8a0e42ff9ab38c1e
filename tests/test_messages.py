"""Messages that help: a wrong call says what was passed and what is wanted, in one line, and a
library call prints no warning of its own making."""

import warnings

import pytest

from analyses import classify_heads, loss_metric, make_task, patch_heads, task_batch, task_metric
from analyses.core.probes import corrupt_first_copy, probes_for
from analyses.tasks.task import measure_intervals
from interp import UserError, load_model


@pytest.fixture(scope="module")
def toy():
    return load_model("toy")


def test_classify_heads_given_a_text_where_the_prompt_count_goes_says_how_to_pass_texts(toy):
    with pytest.raises(UserError) as refused:
        classify_heads(toy, "the cat sat")
    assert str(refused.value) == ("classify_heads(model, 'the cat sat'): the second argument is n_prompts, a number of "
                                  "probes; score texts with texts=[...], e.g. classify_heads(model, "
                                  "texts=['the cat sat'])")
    with pytest.raises(UserError, match=r"^n_prompts=2.5 is not a whole number$"):
        probes_for(toy, 2.5)


def test_a_task_file_row_without_a_field_says_what_it_has(toy, tmp_path):
    """A JSONL row with a misspelt field names what it lacks, what a row needs and what it has, as a
    CSV file's header does, so the typo shows."""
    from analyses import load_task

    path = tmp_path / "mine.jsonl"
    path.write_text('{"clean": "a b", "corrupt": "c d", "answer": " b", "distractor": ""}\n')
    with pytest.raises(UserError) as refused:
        load_task(toy, path)
    assert str(refused.value) == ("mine.jsonl, row 1: missing corrupted, distractor; a row needs clean, corrupted, "
                                  "answer, distractor, and has 'clean', 'corrupt', 'answer'")


def test_a_metric_built_for_as_many_other_prompts_says_so(toy):
    """A loss metric built for 8 prompts given 16 of the same length names the mismatch and what to do,
    as the metric reading past the end does, in one grammatical line."""
    built_for, passed = probes_for(toy, 8, seq_len=16), probes_for(toy, 16, seq_len=16)
    metric = loss_metric(built_for.tokens, built_for.predictable)
    with pytest.raises(UserError) as refused:
        patch_heads(toy, passed.tokens, corrupt_first_copy(passed), metric, progress=False)
    assert str(refused.value) == ("the metric got logits of shape (16, 8, 257), but the rows and positions the loss "
                                  "metric reads expect (8, 8, d_vocab): it was built for other prompts; build it from "
                                  "the prompts you pass")


def test_a_metric_built_for_other_prompts_says_so(toy):
    task = make_task(toy, "ioi", n=4)
    batch = task_batch(toy, task)
    metric = task_metric(task, batch.last)  # reads each IOI prompt's last token, past position 40
    probes = probes_for(toy, 4, seq_len=16)
    with pytest.raises(UserError) as refused:
        patch_heads(toy, probes.tokens, corrupt_first_copy(probes), metric, progress=False)
    first = int(batch.last.unique()[0])
    assert str(refused.value) == (f"the metric reads position {first}, but these prompts have 16 tokens (allowed -16 .. "
                                  "15): it was built for other, longer prompts; build it from the prompts you pass")


def test_measure_intervals_on_logits_with_a_graph_warns_nothing(toy):
    task = make_task(toy, "induction-text", n=4)
    batch = task_batch(toy, task)
    logits = toy(batch.clean)
    assert logits.requires_grad
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        frame = measure_intervals(task, batch.last, logits)
    assert frame["ci_low"].item() <= frame["value"].item() <= frame["ci_high"].item()


def test_every_command_words_an_interval_alike(toy, tmp_path, capsys):
    """``+0.123 [+0.050, +0.200]`` (``effect_text``): the fact-set trace's total effect and the
    control's sentence as the report's tables and ``interp ablate`` print them."""
    import re

    import pandas as pd

    from analyses.cli import main
    from analyses.interventions.controls import describe_control
    from test_tracing_answers import known_facts

    row = pd.Series({"heads": "L1H0", "method": "zero", "effect": 0.1, "ci_low": 0.05, "ci_high": 0.15,
                     "matching": "layer-matched", "n_heads": 1, "random_effect": -0.02, "random_ci_low": -0.04,
                     "random_ci_high": 0.0, "ratio": 5.0, "ratio_ci_low": 2.0, "ratio_ci_high": 9.0, "z": 4.0, "z_ci_low": 2.5, "z_ci_high": 6.0,
                     "z_p_value": 6.3e-5, "p_value": 0.01, "edit": "ablation",
                     "n_draws": 50, "n_distinct": 50, "n_prompts": 8})
    assert "effect +0.100 [+0.050, +0.150]; layer-matched random sets of 1: mean -0.020 [-0.040, +0.000]" in \
        describe_control(row)
    facts = tmp_path / "facts.csv"
    pd.DataFrame([{"prompt": f.prompt, "subject": f.subject, "answer": f.answer} for f in known_facts(toy)]).to_csv(
        facts, index=False)
    assert main(["trace", "--facts", str(facts), "--samples", "1", "--out", str(tmp_path / "t"), "--quiet"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "total effect" in line)
    assert re.search(r"total effect \(clean - noised p\(answer\)\) [+-]\d\.\d{4} \[[+-]\d\.\d{4}, [+-]\d\.\d{4}\]$", line)


def test_the_qk_sections_table_words_its_intervals_as_every_table_does():
    """The report's "Why the role heads attend" table: an effect with its interval as
    ``effect_text`` words it, and one measured without an interval (a screened edge's estimate) says
    ``[no interval]``, not ``[+nan, +nan]``."""
    import pandas as pd

    from analyses.report.qk_section import edge_table

    nan = float("nan")
    edges = pd.DataFrame({"sender_layer": [0, 0], "sender_head": [3, 2], "receiver_layer": [1, 1],
                          "receiver_head": [5, 4], "via": ["k", "k"], "qk_share": [0.6, 0.3],
                          "qk_ci_low": [0.5, 0.2], "qk_ci_high": [0.7, 0.4], "composition_minus_baseline": [0.2, nan],
                          "effect": [2.1, 0.5], "ci_low": [1.8, nan], "ci_high": [2.4, nan]})
    table = edge_table(edges)
    assert table["path patching effect (nats)"].tolist() == ["+2.100 [+1.800, +2.400]", "+0.500 [no interval]"]
    assert table["QK share"].tolist() == ["+0.60 [+0.50, +0.70]", "+0.30 [+0.20, +0.40]"]
