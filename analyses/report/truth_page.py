"""The report's ground-truth section (issue 25): for a model whose true circuit is stored beside
it (``interp tracr`` writes ``ground_truth/``, ``analyses.circuits.ground_truth``), every
discovery method scored against the truth on the stored task
(``analyses.circuits.circuit_eval.evaluate_known``): a table of ROC AUCs (with the bound no
method can beat on that task), the true circuit's and its complement's faithfulness, and the
faithfulness-vs-size figure.

A model with a stored truth is a Tracr compilation, whose logits are its program's output space,
not next tokens, even where ``d_vocab_out`` happens to equal ``d_vocab`` (``hist`` compiled with
max_seq_len 4: 5 counts, 5 input ids). The head-role sections' next-token measures cannot read
them, so ``interp report`` writes this section alone for it (``write_truth_report``), and the
page says why. Models without a stored truth get the head-role report as before.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analyses.circuits.circuit_eval import curve_figure, evaluate_known
from analyses.circuits.ground_truth import TRUTH_DIR, KnownTruth
from analyses.core.plots import png_bytes
from analyses.report.meta import model_meta
from analyses.report.page import ReportFigure, Section, write_report_files

CAPTION = "Faithfulness of each node method's top-k components against k (1: the model's output kept)"


def truth_table(scores: pd.DataFrame) -> pd.DataFrame:
    """``evaluate_discovery``'s scores -> the page's table: ``method, level, auc, bound, true,
    items, faithfulness, note`` rounded to 3 decimals."""
    table = scores.rename(columns={"n_true": "true", "n_items": "items"}).drop(columns="seconds")
    return table.round(3)


def truth_section(model, truth: KnownTruth) -> tuple[Section, pd.DataFrame]:
    """(the ground-truth section, the full scores frame) for ``model`` and its stored truth."""
    scores, curves = evaluate_known(model, truth)
    task = truth.task
    n_true = int(truth.nodes.true.sum())
    circuit = scores.set_index("method")["faithfulness"]
    text = (f"This model is the Tracr compilation of `{task['program']}` (vocabulary {task['vocab']}, "
            f"max_seq_len {task['max_seq_len']}), so its circuit is known: {n_true} of {len(truth.nodes)} "
            f"components and {len(truth.edges)} edges, read from the compiler (`{TRUTH_DIR}/`). Each method is "
            f"scored by ROC AUC against it on {len(task['inputs'])} inputs paired as `{task['pairs']}`; `bound` is "
            f"the AUC no method can beat there (true components constant over the inputs score 0). The true "
            f"circuit keeps {circuit['true circuit']:.3g} of the output (faithfulness) and its complement "
            f"{circuit['complement']:.3g}. Metric: {task['metric']}.")
    figure = ReportFigure("faithfulness_vs_size", CAPTION, png_bytes(curve_figure(curves, task["program"]), CAPTION))
    return Section("Ground truth", text, figures=[figure], table=truth_table(scores)), scores


def write_truth_report(model, truth: KnownTruth, model_name: str, out: str | Path) -> Path:
    """A report directory holding the ground-truth section alone (report.md, index.html,
    figures/, discovery.csv, meta.json), for a model with a stored truth (see the module docstring)."""
    section, scores = truth_section(model, truth)
    why = Section("Head roles", f"Not on this page: the head-role sections score next-token predictions, and this "
                                f"model's {model.cfg.d_vocab_out} logits are its program's output space, not next "
                                f"tokens.")
    meta = model_meta(model, model_name) | {"ground_truth": {k: v for k, v in truth.task.items() if k != "inputs"},
                                            "inputs": len(truth.task["inputs"])}
    return write_report_files(out, f"Ground truth: {model_name}", f"Tracr program `{truth.task['program']}`.",
                              [section, why], meta, {"discovery.csv": scores})
