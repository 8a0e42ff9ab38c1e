"""``interp report``: the head-role report (DESIGN 4.4), one directory per model:

    head_roles.csv   one row per head: layer, head, each measure with _ci_low/_ci_high,
                     ablation_effect, role (the assigned roles joined by ';')
    report.md        the roles found, their ablation effects, the figures (figures/*.png)
    index.html       the same, self-contained (figures embedded as base64 PNG)
    meta.json        model spec, family, impl, weights hash, prompts, seq_len, seed, thresholds,
                     package versions

Same model, prompts and seed -> the same bytes. Every file is written atomically.
"""

from __future__ import annotations

import argparse
import base64
import html
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd
import torch

from interp.files import write_atomic
from analyses.attention_map import all_patterns
from analyses.causal_check import ablation_effects
from analyses.classify import DEFAULT_THRESHOLD, MEASURES, ROLES, classify_heads, head_table
from analyses.outputs import add_model_args, load_cli_model, model_meta, write_meta
from analyses.plots import attention_grid, png_bytes, role_heatmaps
from analyses.probes import RepeatedProbes, probes_for
from analyses.progress import progress_bar
from analyses.tokens import leading_tokens
from interp.errors import UserError

DISPLAY_TEXT = "the cat sat on the mat. the cat sat on the mat."
DISPLAY_TOKENS = 64  # the layer map shows at most this many tokens of its text
FLOAT_FORMAT = "%.6f"
FIGURE_CAPTIONS = {
    "role_scores": "Role scores and ablation effect per head (layer x head)",
    "top_heads": "The top-scoring head of each role on one probe prompt",
    "layer_map": "Every head of one layer on one text",
}


@dataclass
class HeadReport:
    """table: one row per head (see ``head_table``); figures: name -> PNG bytes; meta: JSON-able."""

    table: pd.DataFrame
    figures: dict[str, bytes]
    meta: dict


def build_report(model, *, model_name: str, n_prompts: int = 64, seq_len: int | None = None, seed: int = 0,
                 texts: Sequence[str] | None = None, thresholds: float | Mapping[str, float] = DEFAULT_THRESHOLD,
                 progress: bool | None = None) -> HeadReport:
    """Classify every head (on probes, or on ``texts``), run the ablation check on the probes,
    draw the figures. The probes are drawn once and serve all three. ``model_name``: the spec the
    model was loaded from, for meta.json."""
    if n_prompts < 1:
        raise UserError(f"prompts={n_prompts} must be >= 1")
    steps = progress_bar(total=3, progress=progress, desc="report", unit="step")
    probes = probes_for(model, n_prompts, seq_len, seed=seed)
    scores = classify_heads(model, seed=seed, texts=texts, probes=None if texts else probes, progress=progress)
    steps.update()
    table = head_table(scores, ablation_effects(model, probes, progress=progress), thresholds)
    steps.update()
    figures = {"role_scores": png_bytes(role_heatmaps(table, heatmap_columns(table))),
               "top_heads": png_bytes(top_heads_figure(model, table, probes)),
               "layer_map": png_bytes(layer_map_figure(model, table, texts[0] if texts else DISPLAY_TEXT))}
    steps.update()
    steps.close()
    meta = model_meta(model, model_name) | {"prompts": n_prompts, "seq_len": probes.seq_len, "seed": seed,
                                            "texts": len(texts) if texts else None, "thresholds": thresholds}
    return HeadReport(table, figures, meta)


def heatmap_columns(table: pd.DataFrame) -> list[str]:
    return [m for m in (*ROLES, "entropy") if m in table.columns] + ["ablation_effect"]


def present_roles(table: pd.DataFrame) -> list[str]:
    return [role for role in ROLES if role in table.columns]


def display_probe(probes: RepeatedProbes) -> torch.Tensor:
    """The probe whose second copy ends first, cut right after it -> tokens (pos,): the shortest
    prompt that shows a whole repeat."""
    ends = probes.segment_start + 2 * probes.period  # (batch,) first position after the second copy
    row = int(ends.argmin())
    return probes.tokens[row, : int(ends[row])]


def top_heads_figure(model, table: pd.DataFrame, probes: RepeatedProbes):
    """Each role's best head on the display probe."""
    probe = display_probe(probes)
    patterns = all_patterns(model, probe)
    picks = [(role, table.loc[table[role].idxmax()]) for role in present_roles(table)]
    chosen = patterns[[int(row["layer"]) for _, row in picks], [int(row["head"]) for _, row in picks]]
    titles = [f"{role}: L{int(row['layer'])}H{int(row['head'])} ({row[role]:.2f})" for role, row in picks]
    return attention_grid(chosen, model.to_str_tokens(probe), titles, suptitle="top head per role")


def layer_map_figure(model, table: pd.DataFrame, text: str):
    """Every head of the layer holding the best induction (else previous-token) head, on the start
    of ``text`` (as much as the context holds, at most ``DISPLAY_TOKENS``)."""
    key = "induction" if "induction" in table.columns else "previous_token"
    layer = int(table.loc[table[key].idxmax(), "layer"])
    tokens = leading_tokens(model, text, DISPLAY_TOKENS)
    patterns = all_patterns(model, tokens)[layer]
    titles = [f"L{layer}H{head}" for head in range(model.cfg.n_heads)]
    return attention_grid(patterns, model.to_str_tokens(tokens), titles, suptitle=f"layer {layer}")


def role_summary(table: pd.DataFrame) -> list[str]:
    """Markdown lines: for each role, its heads (best first) with score and ablation effect."""
    lines = []
    for role in present_roles(table):
        heads = table[table["role"].str.split(";").apply(lambda roles: role in roles)]
        heads = heads.sort_values(role, ascending=False)
        found = ", ".join(f"L{int(r.layer)}H{int(r.head)} (score {getattr(r, role):.2f}, "
                          f"ablation {r.ablation_effect:+.3f} nats)" for r in heads.itertuples())
        lines.append(f"- **{role}**: {found or 'none'}")
    return lines


def markdown_table(table: pd.DataFrame) -> list[str]:
    columns = ["layer", "head", "role", *[m for m in MEASURES if m in table.columns], "ablation_effect"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in table[columns].itertuples(index=False):
        cells = [f"{value:.3f}" if isinstance(value, float) else str(value) for value in row]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render_markdown(report: HeadReport) -> str:
    meta = report.meta
    lines = [f"# Head roles: {meta['model']}", "",
             f"family `{meta['family']}`, impl `{meta['impl']}`, weights `{meta['weights_hash']}`, "
             f"{meta['prompts']} probe prompts of {meta['seq_len']} tokens, seed {meta['seed']}"
             + (f", {meta['texts']} texts" if meta["texts"] else "") + ".", "",
             "A head has a role when its score is at least the threshold and its 95% bootstrap interval "
             "lies above chance (a uniform head's score). Ablation effect: the rise in loss on the "
             "predictable second-copy tokens when the head is mean-ablated.", "",
             "## Roles", "", *role_summary(report.table), "", "## Figures", ""]
    for name, caption in FIGURE_CAPTIONS.items():
        lines += [f"![{caption}](figures/{name}.png)", ""]
    lines += ["## All heads", "", *markdown_table(report.table), ""]
    return "\n".join(lines)


def render_html(report: HeadReport) -> str:
    meta = report.meta
    figures = "\n".join(
        f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,'
        f'{base64.b64encode(report.figures[name]).decode("ascii")}"><figcaption>{html.escape(caption)}</figcaption></figure>'
        for name, caption in FIGURE_CAPTIONS.items())
    summary = "".join(f"<li>{html.escape(line[2:]).replace('**', '')}</li>" for line in role_summary(report.table))
    table = report.table.to_html(index=False, float_format=lambda v: f"{v:.3f}", border=0)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Head roles: {html.escape(meta['model'])}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; max-width: 1400px; }}
img {{ max-width: 100%; }}
figure {{ margin: 1em 0; }}
table {{ border-collapse: collapse; font-size: 12px; }}
th, td {{ padding: 2px 6px; border-bottom: 1px solid #ddd; text-align: right; }}
</style>
</head>
<body>
<h1>Head roles: {html.escape(meta['model'])}</h1>
<p>family <code>{html.escape(meta['family'])}</code>, impl <code>{html.escape(meta['impl'])}</code>,
weights <code>{html.escape(meta['weights_hash'])}</code>, {meta['prompts']} probe prompts of {meta['seq_len']} tokens, seed {meta['seed']}.</p>
<h2>Roles</h2>
<ul>{summary}</ul>
<h2>Figures</h2>
{figures}
<h2>All heads</h2>
{table}
</body>
</html>
"""


def write_report(report: HeadReport, out: str | Path) -> Path:
    """Write the report directory (each file atomically)."""
    out = Path(out)
    (out / "figures").mkdir(parents=True, exist_ok=True)
    for name, png in report.figures.items():
        write_atomic(out / "figures" / f"{name}.png", png)
    write_atomic(out / "head_roles.csv", report.table.to_csv(index=False, float_format=FLOAT_FORMAT, lineterminator="\n"))
    write_atomic(out / "report.md", render_markdown(report))
    write_atomic(out / "index.html", render_html(report))
    write_meta(out, report.meta)
    return out


def read_texts(path: str) -> list[str]:
    """One text per non-empty line of ``path``."""
    if not Path(path).is_file():
        raise UserError(f"text file {path!r} does not exist")
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise UserError(f"text file {path!r} has no non-empty lines")
    return lines


def run(args: argparse.Namespace) -> int:
    if args.prompts < 1:
        raise UserError(f"--prompts {args.prompts} must be >= 1")
    texts = read_texts(args.text_file) if args.text_file else None
    model = load_cli_model(args)
    report = build_report(model, model_name=str(args.model), n_prompts=args.prompts, seq_len=args.seq_len,
                          seed=args.seed, texts=texts, thresholds=args.threshold)
    print(write_report(report, args.out))
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("report", help="classify every head and write the head-role report")
    add_model_args(parser)
    parser.add_argument("--prompts", type=int, default=64, help="number of probe prompts (default 64)")
    parser.add_argument("--seq-len", type=int, default=None, help="probe length (default min(n_ctx, 128))")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text-file", default=None, help="score the text-defined roles on these texts (one per line)")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help="role score threshold (default 0.4)")
    parser.add_argument("--out", default="reports/toy", help="output directory (default reports/toy)")
    parser.set_defaults(func=run)
