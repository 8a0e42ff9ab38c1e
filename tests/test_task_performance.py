"""Whether the model performs a task, and a task it does not perform said on its page and in the
terminal: the toy model does not do IOI (its clean prompts score below the corrupted ones) and does
do induction on text."""

import json
import re

import pandas as pd
import pytest
import torch

from analyses.cli import main
from analyses.core.stats import resample_weights
from analyses.tasks.task import make_task, task_batch, task_scores
from interp import load_model


@pytest.fixture(scope="module")
def toy():
    return load_model("toy")


def naive_gap(model, name: str, n: int) -> tuple[float, float, float]:
    """The clean - corrupted metric, prompt by prompt from two plain forwards, with its 95% percentile
    bootstrap over prompts written out with numpy (the same seeded resamples as every interval)."""
    task = make_task(model, name, n=n)
    batch = task_batch(model, task)
    scores = task_scores(task, batch.last)
    with torch.no_grad():
        gaps = (scores(model(batch.clean)) - scores(model(batch.corrupted))).double().numpy()
    weights = resample_weights(len(gaps), seed=0).numpy()
    resampled = weights @ gaps / weights.sum(1)
    low, high = pd.Series(resampled).quantile([0.025, 0.975]).tolist()
    return float(gaps.mean()), low, high


def run_task(name: str, out, capsys) -> tuple[str, str, dict]:
    assert main(["task", name, "--n", "8", "--top", "1", "--no-split", "--exact-all", "--out", str(out),
                 "--quiet"]) == 0
    return capsys.readouterr().out, (out / "report.md").read_text(), json.loads((out / "meta.json").read_text())


def test_a_task_the_model_does_not_perform_opens_its_page_and_output_with_a_banner_and_marks_its_circuit(
        toy, tmp_path, capsys):
    gap, low, high = naive_gap(toy, "ioi", 8)
    assert high < 0  # the toy scores its corrupted IOI prompts higher than its clean ones
    printed, page, meta = run_task("ioi", tmp_path / "ioi", capsys)
    metric = pd.read_csv(tmp_path / "ioi" / "metric.csv").set_index("run").loc["clean - corrupted"]
    assert [metric["metric"], metric["ci_low"], metric["ci_high"]] == pytest.approx([gap, low, high], abs=1e-5)
    assert f"WARNING: The model does not perform this task: clean - corrupted logit_diff {gap:+.3f} " in printed
    assert "lies below 0: the corrupted prompts score higher" in printed
    sections = page.split("\n## ")
    assert sections[1].startswith("The model does not perform this task")
    for title in ("Patching", "Circuit", "Chosen heads, measured"):
        section = next(text for text in sections if text.startswith(title + "\n"))
        assert "**Built on noise**" in section, title
    assert meta["performs_task"] is False and meta["performance"].startswith("The model does not perform")


def test_the_first_line_names_the_split_its_values_are_from_before_the_verdict_on_the_other(toy, tmp_path, capsys):
    """With the default split, ``interp task`` prints the unpatched values of the selection split, then
    the verdict on the measurement split: the first line says which prompts its numbers are from, so
    two different "clean" values on one screen do not look like a contradiction."""
    assert main(["task", "ioi", "--n", "40", "--top", "1", "--out", str(tmp_path / "t"), "--quiet"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    metric = pd.read_csv(tmp_path / "t" / "metric.csv").set_index(["run", "split"])["metric"]
    n_selection = json.loads((tmp_path / "t" / "meta.json").read_text())["split"]["sizes"]["selection"]
    assert (f"logit_diff on the {n_selection} selection prompts clean {metric['clean', 'selection']:.4f}, "
            f"corrupted {metric['corrupted', 'selection']:.4f};") in first


def test_a_task_the_model_performs_has_no_banner(toy, tmp_path, capsys):
    gap, low, high = naive_gap(toy, "induction-text", 8)
    assert low > 0
    printed, page, meta = run_task("induction-text", tmp_path / "induction", capsys)
    assert f"The model performs the task: clean - corrupted logit_diff {gap:+.3f} [{low:+.3f}, {high:+.3f}]" in printed
    assert "WARNING" not in printed and "does not perform" not in page and "Built on noise" not in page
    assert meta["performs_task"] is True


def test_the_pages_tables_write_a_value_not_measured_blank_and_a_count_whole():
    """The task page's metric table has no interval on the selection split: its cells are blank, not
    "nan", and n_prompts beside them reads 30, not 30.000 (a count made float by the missing values)."""
    from analyses.report.page import markdown_table, plain_table_html

    nan = float("nan")
    table = pd.DataFrame({"run": ["clean", "clean"], "split": ["selection", "measurement"], "metric": [-0.1641, -0.1937],
                          "ci_low": [nan, -0.6443], "n_prompts": [nan, 30.0]})
    assert markdown_table(table)[2:] == ["| clean | selection | -0.164 |  |  |",
                                         "| clean | measurement | -0.194 | -0.644 | 30 |"]
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", plain_table_html(table))
    assert cells == ["clean", "selection", "-0.164", "", "", "clean", "measurement", "-0.194", "-0.644", "30"]
