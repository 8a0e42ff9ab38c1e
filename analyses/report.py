"""``interp report``: the head-role report (DESIGN 4.4), one directory per model:

    head_roles.csv   one row per head: layer, head, each measure with _ci_low/_ci_high,
                     ablation_effect, role (the assigned roles joined by ';')
    report.md        the roles found, their ablation effects, the figures (figures/*.png)
    index.html       the same, self-contained (figures embedded as base64 PNG)
    meta.json        model, impl, prompts, seq_len, seed, thresholds, package versions

Same model, prompts and seed -> the same bytes. Every file is written atomically.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import platform
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd
from tqdm.auto import tqdm

from interp.files import write_atomic
from analyses.attention_map import all_patterns
from analyses.causal_check import ablation_effects
from analyses.classify import DEFAULT_THRESHOLD, MEASURES, ROLES, classify_heads, head_table
from analyses.plots import attention_grid, png_bytes, role_heatmaps
from analyses.probes import probes_for
from interp.errors import UserError

DISPLAY_TEXT = "the cat sat on the mat. the cat sat on the mat."
DISPLAY_LEN = 32
FLOAT_FORMAT = "%.6f"
VERSIONED = ("interp", "torch", "transformer-lens", "transformers", "matplotlib", "seaborn", "pandas")
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


def build_report(model, *, model_name: str, impl: str = "scratch", n_prompts: int = 64, seq_len: int | None = None,
                 seed: int = 0, texts: Sequence[str] | None = None,
                 thresholds: float | Mapping[str, float] = DEFAULT_THRESHOLD, progress: bool | None = None) -> HeadReport:
    """Classify every head, run the ablation check, draw the figures."""
    if n_prompts < 1:
        raise UserError(f"prompts={n_prompts} must be >= 1")
    steps = tqdm(total=3, desc="report", unit="step", disable=None if progress is None else not progress)
    scores = classify_heads(model, n_prompts, seq_len, seed, texts, progress=progress)
    steps.update()
    probes = probes_for(model, n_prompts, seq_len, seed=seed)
    table = head_table(scores, ablation_effects(model, probes, progress=progress), thresholds)
    steps.update()
    figures = {"role_scores": png_bytes(role_heatmaps(table, heatmap_columns(table))),
               "top_heads": png_bytes(top_heads_figure(model, table, seed)),
               "layer_map": png_bytes(layer_map_figure(model, table, texts[0] if texts else DISPLAY_TEXT))}
    steps.update()
    steps.close()
    meta = {"model": model_name, "impl": impl, "prompts": n_prompts, "seq_len": probes.seq_len, "seed": seed,
            "texts": len(texts) if texts else None, "thresholds": thresholds, "versions": versions()}
    return HeadReport(table, figures, meta)


def heatmap_columns(table: pd.DataFrame) -> list[str]:
    return [m for m in (*ROLES, "entropy") if m in table.columns] + ["ablation_effect"]


def present_roles(table: pd.DataFrame) -> list[str]:
    return [role for role in ROLES if role in table.columns]


def top_heads_figure(model, table: pd.DataFrame, seed: int):
    """Each role's best head on one short probe prompt."""
    probe = probes_for(model, 1, min(model.cfg.n_ctx, DISPLAY_LEN), seed=seed).tokens[0]
    patterns = all_patterns(model, probe)
    picks = [(role, table.loc[table[role].idxmax()]) for role in present_roles(table)]
    chosen = patterns[[int(row["layer"]) for _, row in picks], [int(row["head"]) for _, row in picks]]
    titles = [f"{role}: L{int(row['layer'])}H{int(row['head'])} ({row[role]:.2f})" for role, row in picks]
    return attention_grid(chosen, model.to_str_tokens(probe), titles, suptitle="top head per role")


def layer_map_figure(model, table: pd.DataFrame, text: str):
    """Every head of the layer holding the best induction (else previous-token) head, on ``text``."""
    key = "induction" if "induction" in table.columns else "previous_token"
    layer = int(table.loc[table[key].idxmax(), "layer"])
    tokens = model.to_tokens(text)[0][: min(model.cfg.n_ctx, 2 * DISPLAY_LEN)]
    patterns = all_patterns(model, tokens)[layer]
    titles = [f"L{layer}H{head}" for head in range(model.cfg.n_heads)]
    return attention_grid(patterns, model.to_str_tokens(tokens), titles, suptitle=f"layer {layer}")


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in VERSIONED:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


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
             f"impl `{meta['impl']}`, {meta['prompts']} probe prompts of {meta['seq_len']} tokens, seed {meta['seed']}"
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
<p>impl <code>{html.escape(meta['impl'])}</code>, {meta['prompts']} probe prompts of {meta['seq_len']} tokens, seed {meta['seed']}.</p>
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
    write_atomic(out / "meta.json", json.dumps(report.meta, indent=2, sort_keys=True) + "\n")
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
    from interp import load_model

    if args.prompts < 1:
        raise UserError(f"--prompts {args.prompts} must be >= 1")
    texts = read_texts(args.text_file) if args.text_file else None
    model = load_model(args.model, impl=args.impl)
    report = build_report(model, model_name=str(args.model), impl=args.impl, n_prompts=args.prompts,
                          seq_len=args.seq_len, seed=args.seed, texts=texts, thresholds=args.threshold)
    print(write_report(report, args.out))
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("report", help="classify every head and write the head-role report")
    parser.add_argument("--model", default="toy", help="toy (default), a checkpoint or GPT-2 directory, or a hub name")
    parser.add_argument("--impl", default="scratch", choices=["scratch", "transformer_lens"])
    parser.add_argument("--prompts", type=int, default=64, help="number of probe prompts (default 64)")
    parser.add_argument("--seq-len", type=int, default=None, help="probe length (default min(n_ctx, 128))")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text-file", default=None, help="score the text-defined roles on these texts (one per line)")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help="role score threshold (default 0.4)")
    parser.add_argument("--out", default="reports/toy", help="output directory (default reports/toy)")
    parser.set_defaults(func=run)
