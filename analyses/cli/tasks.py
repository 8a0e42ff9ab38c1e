"""``interp trace``: causal tracing (``analyses.tasks.tracing``) of one prompt, written as ``trace.csv``,
``trace.png`` (the three heatmaps) and ``meta.json``; or with ``--facts FILE|builtin`` of a fact set
(``analyses.tasks.facts``) kept to the facts the model answers top-1, written as ``aie.csv`` (the
average indirect effect per kind, window, layer and position class with its interval),
``relations.csv`` (the same per relation), ``tokens.csv`` (each fact's per-token curves),
``facts.csv`` (every fact: whether it was kept, its clean and noised probabilities), ``tracing.png``
(Meng et al.'s panels) and ``meta.json`` (with the verdict, ``analyses.tasks.tracing.trace_verdict``,
the one-layer MLP restores and the per-relation lines).

``interp explain NAME|FILE``: attention as explanation on a task's prompts
(``analyses.components.explanation``): token attributions beside the attention of the heads that
matter (the strongest by exact head patching, or ``--heads``), their rank agreement, and whether the
most-attended token is decisive under intervention: ``scores.csv``, ``agreement.csv``,
``decisive.csv``, ``explanation.png``, ``meta.json``.

``interp task NAME|FILE``: a task (``analyses.tasks.task``) on a model -- the metric on the clean and
corrupted runs, head and MLP patching (all positions and by position), direct logit attribution,
path patching from the top senders with edge attribution beside it -- as one offline page
(``analyses/report/task_page.py``): index.html, report.md, figures and CSVs, written as soon as the
clean and corrupted runs (the first step) are done, every later step shown pending with its estimate,
and rewritten (each file whole) as each step lands. The sweeps are screened
by attribution (``--screen-top``, ``--screen-share``: which cells are measured exactly, the others
estimated, said on the page and in meta.json) unless ``--exact-all``. Each step's result is
kept in ``DIR/steps/`` as it finishes (``analyses.core.steps``), so ``--resume`` after an
interruption computes only the steps not yet done; the run holds ``DIR/.lock`` while it runs. The
heads are chosen on a selection split of the prompts and measured on the disjoint measurement split
(``--no-split``: in-sample); the top writers' control ablates by ``--ablation`` (``mean_corrupted``,
each template's corrupted prompts' mean, by default)."""

from __future__ import annotations

from pathlib import Path

import torch

from analyses.components.explanation import decisive_attention, explain, explanation_figure
from analyses.core.execution import executing
from analyses.core.metrics import evaluate_metric
from analyses.interventions.patching import patch_heads
from analyses.report.intervention_figures import save_csv, save_figure
from analyses.cli.args import (SEED, add_chat_arg, add_model_args, arguments_record, check_head_count,
                               fingerprinted_arguments, load_cli_model, number, whole)
from analyses.core.heads import as_heads, head_label
from analyses.core.steps import Steps, check_steps_dir, directory_lock
from analyses.report.meta import model_meta, write_meta
from analyses.core.stats import check_interval_prompts, effect_text
from analyses.tasks.task import (BUILT_IN, TASK_ABLATIONS, chat_task, check_task_prompts, make_task, task_batch,
                                 task_metric, task_scores, task_split)
from interp.errors import UserError
from analyses.interventions.attribution import DEFAULT_SCREEN, Screen
from analyses.report.task_page import analyse_task, page_writer, task_inputs
from analyses.core.tokens import model_tokenizer
from analyses.tasks.facts import BUILTIN, answer_tokens, load_facts, token_list, top1_facts
from analyses.tasks.tracing import (NOISE_FROM, STATES, WINDOW, causal_trace, facts_figure, relation_aie,
                                    relation_lines, single_layer_text, trace_facts, trace_figure, trace_verdict)


def _arguments(args) -> dict:
    """The command's arguments for meta.json (``arguments_record``: a resumed run writes the same
    files as one run through)."""
    return arguments_record(args)


def register(subparsers) -> None:
    trace = subparsers.add_parser("trace", help="causal tracing (Meng et al. 2022): noise the subject, restore "
                                                "each layer x position; of one prompt or of a fact set (--facts)")
    add_model_args(trace)
    trace.add_argument("--facts", help=f"trace a fact set: a CSV file with prompt, subject, answer columns, or "
                                       f"'{BUILTIN}' (the shipped set); kept to the facts the model answers top-1")
    trace.add_argument("--prompt", help="the prompt of a single trace, e.g. 'The Eiffel Tower is in the city of'")
    trace.add_argument("--subject", help="the text in the prompt whose tokens are noised")
    trace.add_argument("--answer", help="the exact continuation, e.g. ' Paris'; its first token is traced, a "
                                        "leading space that is a token of its own moving onto the prompt, as with "
                                        "--facts (default: the clean run's top token)")
    trace.add_argument("--samples", type=whole(1), default=10, help="noise samples (default 10)")
    trace.add_argument("--noise", type=number(above=0), default=3.0, help="noise std in embedding stds (default 3)")
    trace.add_argument("--noise-from", choices=NOISE_FROM, default="subjects",
                       help="the embedding std: of the subjects' tokens (default, as ROME) or of the vocabulary")
    trace.add_argument("--window", type=whole(1), default=WINDOW,
                       help=f"with --facts: MLP and attention layers restored together (default {WINDOW}); single "
                            "layers are restored beside them")
    trace.add_argument("--limit", type=whole(1), help="with --facts: trace only the first N facts kept (at least 2: "
                                                      "the intervals are over facts)")
    trace.add_argument("--state", default="resid_post", choices=STATES,
                       help="the hidden state restored: a layer's output (resid_post, default) or input")
    trace.add_argument("--seed", type=SEED, default=0)
    trace.add_argument("--out", type=Path, required=True, help="output directory")
    trace.set_defaults(func=run_trace)
    register_task(subparsers)
    register_explain(subparsers)


def run_trace(args) -> int:
    if args.facts is None and (args.prompt is None or args.subject is None):
        raise UserError("give --facts FILE|builtin, or --prompt and --subject for a single trace")
    if args.facts is not None and (args.prompt or args.subject or args.answer):
        raise UserError("--facts traces a fact set; --prompt, --subject and --answer are for a single trace")
    facts = load_facts(args.facts) if args.facts is not None else None  # refused before the model loads
    if args.limit is not None:
        check_interval_prompts(args.limit, f"--limit {args.limit}", unit="facts")
    model = load_cli_model(args)
    if facts is not None:
        return _trace_fact_set(model, facts, args)
    trace = causal_trace(model, args.prompt, args.subject, args.answer, samples=args.samples, noise=args.noise,
                         noise_from=args.noise_from, seed=args.seed, state=args.state, memory_mb=args.memory_mb,
                         progress=args.progress)
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = save_csv(trace.frame, args.out / "trace.csv")
    png_path = save_figure(trace_figure(trace), args.out / "trace.png")
    answer = model.to_string([trace.answer]) if hasattr(model, "to_string") else str(trace.answer)
    write_meta(args.out, model_meta(model, args.model) | {
        "command": "trace", "arguments": _arguments(args), "answer_token": trace.answer, "answer": answer,
        "clean_prob": trace.clean_prob, "noised_prob": trace.corrupted_prob, "subject_positions": trace.subject,
        "noise_std": trace.noise_std})
    if args.answer is not None:
        print(answer_split(model, args.prompt, args.answer))
    print(f"p({answer!r}) clean {trace.clean_prob:.4f}, subject noised {trace.corrupted_prob:.4f}")
    for kind in trace.kinds:
        best = trace.frame[trace.frame["kind"] == kind].sort_values("prob").iloc[-1]
        print(f"  best restored {kind}: layer {best['layer']}, position {best['pos']} ({best['token']!r}): "
              f"{best['prob']:.4f}")
    print(f"wrote {csv_path} and {png_path}")
    return 0


def answer_split(model, prompt: str, answer: str) -> str:
    """The line saying how the tokenizer splits ``answer`` after ``prompt`` and which token the trace
    reads, named (``answer_tokens``: the first; a leading space that is a token of its own moves onto the prompt)."""
    traced_prompt, tokens = answer_tokens(model, prompt, answer)
    tokenizer = model_tokenizer(model)
    moved = (f" (its leading {traced_prompt[len(prompt):]!r} is a token of its own here, so it moves onto the prompt)"
             if traced_prompt != prompt else "")
    return (f"answer {answer!r} continues the prompt as {len(tokens)} token(s) {token_list(tokenizer, tokens)}{moved}; "
            f"the trace reads the first, {tokenizer.decode(tokens[:1])!r}")


def _trace_fact_set(model, facts, args) -> int:
    """``interp trace --facts``: filter, trace, write aie.csv, relations.csv, tokens.csv, facts.csv,
    tracing.png, meta.json; print the total effect, the verdict, the one-layer MLP restores and the relations."""
    kept, filtered = top1_facts(model, facts, memory_mb=args.memory_mb, progress=args.progress)
    check_interval_prompts(len(kept), f"{len(kept)} of {len(facts)} facts answered top-1 by this model", unit="facts")
    traced = kept[: args.limit] if args.limit else kept
    found = trace_facts(model, traced, samples=args.samples, noise=args.noise, noise_from=args.noise_from,
                        noise_facts=facts, window=args.window, seed=args.seed, state=args.state,
                        memory_mb=args.memory_mb, progress=args.progress)
    has_mlp = "mlp" in found.kinds
    verdict = trace_verdict(found) if has_mlp else None
    single = single_layer_text(found) if has_mlp else None
    relations = relation_lines(found, args.seed)
    written = filtered.assign(traced=False, clean_prob=float("nan"), corrupted_prob=float("nan"))
    rows = written.index[written["kept"]][: len(traced)]  # the traced facts: the first kept ones, in order
    written.loc[rows, ["clean_prob", "corrupted_prob"]] = found.facts[["clean_prob", "corrupted_prob"]].to_numpy()
    written.loc[rows, "traced"] = True
    args.out.mkdir(parents=True, exist_ok=True)
    save_csv(found.aie, args.out / "aie.csv")
    save_csv(relation_aie(found, args.seed), args.out / "relations.csv")
    save_csv(found.tokens, args.out / "tokens.csv")
    save_csv(written, args.out / "facts.csv")
    save_figure(facts_figure(found, verdict), args.out / "tracing.png")
    effect, low, high = found.total_effect(args.seed)
    write_meta(args.out, model_meta(model, args.model) | {
        "command": "trace", "arguments": _arguments(args), "facts": len(facts), "kept_top1": len(kept),
        "traced": len(traced), "noise_std": found.noise_std, "noise_std_over": found.noise_over,
        "window": found.window,
        "total_effect": {"mean": effect, "ci_low": low, "ci_high": high},
        "verdict": None if verdict is None else verdict.text, "single_layer_mlp": single, "relations": relations})
    print(f"{len(kept)} of {len(facts)} facts answered top-1 ({len(facts) - len(kept)} dropped: their answer token is "
          f"not the model's top next token); traced {len(traced)}; total effect (clean - noised p(answer)) "
          f"{effect_text(effect, low, high, 4)}")
    print(verdict.text if verdict is not None else "no verdict: the model has no MLPs to trace")
    if single is not None:
        print(single)
    print("\n".join(relations))
    print(f"wrote {args.out / 'aie.csv'}, {args.out / 'relations.csv'}, {args.out / 'tokens.csv'}, "
          f"{args.out / 'facts.csv'} and {args.out / 'tracing.png'}")
    return 0


# ------------------------------------------------------------------------------ interp task
def register_task(subparsers) -> None:
    task = subparsers.add_parser("task", help="a task (ioi, greater-than, induction-text or a JSONL/CSV file): "
                                              "metric, patching, DLA, path patching, one offline page")
    task.add_argument("name", help=f"{', '.join(BUILT_IN)}, or a .jsonl / .csv file of clean, corrupted, answer, "
                                   "distractor rows")
    add_model_args(task)
    add_chat_arg(task)
    task.add_argument("--n", type=whole(1), help="number of prompts (default: the generator's, or every row)")
    task.add_argument("--top", type=whole(1), default=3, help="path-patch from this many top heads (default 3)")
    task.add_argument("--seed", type=SEED, default=0)
    task.add_argument("--exact-all", action="store_true",
                      help="measure every patching cell and path-patching edge exactly (default: attribution "
                           "estimates every one and only those the screen chooses are measured exactly)")
    task.add_argument("--screen-top", type=whole(0), default=DEFAULT_SCREEN.top_k, metavar="K",
                      help=f"the screen measures exactly the K cells (edges) of each sweep with the largest "
                           f"estimated effect (default {DEFAULT_SCREEN.top_k})")
    task.add_argument("--screen-share", type=number(above=0, infinite=True), default=DEFAULT_SCREEN.share, metavar="S",
                      help="... and every cell whose estimated effect reaches S x |clean - corrupted| "
                           f"(default {DEFAULT_SCREEN.share:g})")
    task.add_argument("--no-split", action="store_true",
                      help="choose the heads and measure their effects on the same prompts (in-sample; default: "
                           "choose on a selection split, measure on the disjoint measurement split)")
    task.add_argument("--ablation", choices=TASK_ABLATIONS, default="mean_corrupted",
                      help="how the top writers' control ablates a head (default mean_corrupted: the mean over the "
                           "corrupted prompts of the same template, position by position; plain mean is refused "
                           "for a task of several templates)")
    task.add_argument("--out", type=Path, required=True, help="output directory")
    task.add_argument("--resume", action="store_true", help="finish an interrupted run in OUT: reuse its finished "
                                                            "steps (same model, task and options), compute the rest")
    task.set_defaults(func=run_task)


def prompted_task(model, args):
    """The task ``args.name`` names (``--n``, ``--seed``), its prompts in the chat template with ``--chat``."""
    task = make_task(model, args.name, args.n, args.seed)
    return chat_task(model, task) if args.chat else task


def run_task(args) -> int:
    if not args.exact_all and args.screen_top == 0 and args.screen_share == float("inf"):
        raise UserError("--screen-top 0 with --screen-share inf measures no cell exactly; give --screen-top >= 1, "
                        "a finite --screen-share, or --exact-all")
    screen = None if args.exact_all else Screen(args.screen_top, args.screen_share)  # refused before any load
    if args.n is not None:
        check_task_prompts(args.n, not args.no_split, f"--n {args.n}")
    args.out.mkdir(parents=True, exist_ok=True)
    with directory_lock(args.out, "task run"):
        check_steps_dir(args.out, args.resume)  # before any model loads
        model = load_cli_model(args)
        check_head_count(model, args.top, "--top")
        task = prompted_task(model, args)
        meta = model_meta(model, args.model) | {"command": "task", "arguments": _arguments(args), "task": task.name,
                                                 "prompts": len(task), "dropped": task.dropped, "note": task.note}
        check_task_prompts(len(task), not args.no_split, f"task {task.name!r}")
        split = None if args.no_split else task_split(task, args.seed)
        inputs = task_inputs(model, task, args.top, screen, split, args.ablation)
        steps = Steps(args.out, inputs | {"arguments": fingerprinted_arguments(args)}, resume=args.resume)
        analysis = analyse_task(model, task, top=args.top, screen=screen, split=split or False,
                                ablation=args.ablation, seed=args.seed, memory_mb=args.memory_mb,
                                progress=args.progress, steps=steps, landed=page_writer(args.out, meta))
    out, values = args.out, analysis.values
    reused = f"; reused {len(steps.reused)} finished step(s)" if steps.reused else ""
    on = "" if split is None else f" on the {len(split.selection)} selection prompts"
    print(f"{task.name}: {len(task)} prompts ({task.dropped} dropped); {task.metric}{on} clean {values['clean']:.4f}, "
          f"corrupted {values['corrupted']:.4f}{reused}; wrote {out / 'index.html'}")
    performance = analysis.performance
    print(performance.text if performance.performs else f"WARNING: {performance.text}")
    return 0


# ---------------------------------------------------------------------------- interp explain
def register_explain(subparsers) -> None:
    explain_parser = subparsers.add_parser(
        "explain", help="attention as explanation on a task: attributions (gradient x input, integrated "
                        "gradients, occlusion) beside attention, rollout and flow; is the attended token decisive?")
    explain_parser.add_argument("name", help=f"{', '.join(BUILT_IN)}, or a .jsonl / .csv task file")
    add_model_args(explain_parser)
    add_chat_arg(explain_parser)
    explain_parser.add_argument("--n", type=whole(1), default=8, help="number of prompts (default 8)")
    explain_parser.add_argument("--top", type=whole(1), default=3,
                                help="read the attention of this many heads, the strongest by exact head patching "
                                     "(default 3)")
    explain_parser.add_argument("--heads", help="the heads to read instead, e.g. 9.1,10.0 (layer.head)")
    explain_parser.add_argument("--steps", type=whole(1), default=32, help="integrated gradients' steps (default 32)")
    explain_parser.add_argument("--no-flow", action="store_true", help="skip attention flow (a max-flow per position "
                                                                       "and layer)")
    explain_parser.add_argument("--seed", type=SEED, default=0)
    explain_parser.add_argument("--out", type=Path, required=True, help="output directory")
    explain_parser.set_defaults(func=run_explain)


def parse_heads(text: str) -> list[tuple[int, int]]:
    """"9.1,L10H0" -> [(9, 1), (10, 0)] (``as_heads``)."""
    try:
        return as_heads(text)
    except UserError:
        raise UserError(f"--heads {text!r}: give heads (9.1 or L9H1) separated by commas, e.g. 9.1,L10H0") from None


def strongest_heads(model, clean, corrupted, metric, top: int) -> list[tuple[int, int]]:
    """The ``top`` heads whose exact denoising patch moves ``metric`` furthest from its corrupted value
    (the sweep within the current execution, ``analyses.core.execution``)."""
    with torch.no_grad():
        corrupted_value = evaluate_metric(metric, model(corrupted)).item()
    moved = (patch_heads(model, clean, corrupted, metric) - corrupted_value).abs()
    order = moved.flatten().argsort(descending=True, stable=True)[:top]
    return [divmod(int(index), model.cfg.n_heads) for index in order]


def run_explain(args) -> int:
    model = load_cli_model(args)
    if not args.heads:
        check_head_count(model, args.top, "--top")
    task = prompted_task(model, args)
    batch = task_batch(model, task)
    metric, scores = task_metric(task, batch.last), task_scores(task, batch.last)
    with executing(args.memory_mb, args.progress):
        heads = parse_heads(args.heads) if args.heads else strongest_heads(model, batch.clean, batch.corrupted,
                                                                            metric, args.top)
    found = explain(model, batch.clean, scores, heads, batch.last.cpu(), steps=args.steps, flow=not args.no_flow,
                    memory_mb=args.memory_mb)
    decisive = decisive_attention(model, batch.clean, scores, heads, batch.last.cpu(), seed=args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    for frame, name in ((found.scores, "scores"), (found.agreement, "agreement"), (decisive, "decisive")):
        save_csv(frame, args.out / f"{name}.csv")
    save_figure(explanation_figure(found), args.out / "explanation.png")
    write_meta(args.out, model_meta(model, args.model) | {"command": "explain", "arguments": _arguments(args),
                                                         "task": task.name, "prompts": len(task),
                                                         "heads": [list(head) for head in heads]})
    print(f"{task.name}: {len(task)} prompts; attention of heads {', '.join(map(head_label, heads))}")
    print("Spearman correlation with each attribution's magnitude, median over prompts:")
    print(found.summary().pivot(index="attention", columns="attribution", values="median").round(2).to_string())
    with torch.no_grad():
        clean = scores(model(batch.clean)).abs().median().item()
    print(f"the most-attended token (start token excluded): median |score change| when edited (clean median "
          f"|{task.metric}| {clean:.3f}):")
    print(decisive.groupby(["layer", "head"])[["top_weight", "knockout", "permuted", "erased"]]
          .agg(lambda column: column.abs().median()).round(3).to_string())
    print(f"wrote {args.out}")
    return 0
