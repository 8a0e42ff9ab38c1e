"""SmolLM2's IOI circuit by its edges: path patching into the answer writers' queries, the circuit's
faithfulness as a curve (top-k edges kept) with its complement, and exact edge patching against
EAP and EAP-IG on it.

Prompts: ``ioi_task`` (ABBA for one pass over the 15 templates, BABA for the next; the corruption
puts three other names in the same template); the metric is logit(IO) - logit(S) at the last token
(``task_metric``). ``task_split`` (seed 0) splits the prompts by template: half of each template's
prompts choose (the writers, the nodes, every edge ranking), the other half test (path patching
into the writers, the interventions, every curve), so nothing is measured on the prompts that chose
it; each template needs at least two prompts (at least 30 prompts), and the split does not balance
ABBA against BABA within a template (at the default 30: 8 ABBA and 7 BABA choose, 7 and 8 test).

1. Writers: the top 3 heads by direct logit attribution. Senders into their queries: path patching
   by noising (the clean run with one sender's write into one writer's query input taken from the
   corrupted run) from every earlier head, EAP shortlisting the edges and exact path patching
   confirming the top ``SHORTLIST`` (``shortlist_path_patch``); what the top senders attend to from
   the last token; then the intervention: the clean run with only the top senders' writes into the
   writers' queries corrupted (``circuit_scores``), against the same cut of ``N_DRAWS`` random sets
   matched to the senders by layer (and key/value group), none of the heads whose summed path effect
   on the choosing prompts is below -``PATH_MIN``: ``control_from_scores``' effect, random mean,
   ratio and z, each with its interval over the test prompts.
2. Candidate edges: every q/k/v edge among the top ``--nodes`` heads by |head patching| (noising)
   and each of them to the logits; each ranked by |exact path patching by noising| (the change when
   that edge alone carries its corrupted write), by |EAP| and by |EAP-IG| (both by noising, as
   Hanna et al. 2024 score edges), and by the signed exact effect (the edges whose removal lowers
   the logit difference most first); ``faithfulness_curve``: the circuit of the top k edges kept
   (every other candidate edge carries its corrupted write) and its complement, each with its 95%
   interval over the test prompts; ``faithfulness_figure`` draws both (complements against the k
   edges removed).
3. Rank agreement of EAP and EAP-IG with exact (Spearman, top-k overlap) and faithfulness at equal k,
   each difference of two rankings' faithfulness at one k with its paired interval (the same prompt
   resamples for both: ``paired_difference``).

    python examples/smollm2/ioi_circuit.py            # 30 prompts (15 choose, 15 test), 20 nodes
    python examples/smollm2/ioi_circuit.py --nodes 8  # 89 candidate edges: about two thirds of the time
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from analyses import edge_agreement, patch_heads, path_patch, shortlist_path_patch
from analyses.circuits.edge_circuit import circuit_scores, faithfulness_curve, faithfulness_figure
from analyses.circuits.edges import edges_of
from analyses.circuits.ioi_classes import PATH_MIN
from analyses.core.metrics import PromptScores
from analyses.core.stats import paired_difference
from analyses.interventions.controls import ControlEffects, control_from_scores, matched_random_sets
from analyses.tasks.task import ioi_task, task_batch, task_metric, task_split
from ioi import writers as head_writers
from setup_smollm2 import head_name, load

FIGURE = Path(__file__).resolve().parents[2] / "docs" / "smollm2_ioi_faithfulness.png"
N_WRITERS = 3
N_SENDERS = 3
SHORTLIST = 20
IG_STEPS = 5
N_DRAWS = 50  # random sets of the query-path control
METHODS = ("exact", "EAP", "EAP-IG")


def name(head) -> str:
    return head_name(*head)


def edge_name(row) -> str:
    receiver = "logits" if row.receiver_head < 0 else f"{head_name(row.receiver_layer, row.receiver_head)}.{row.via}"
    return f"{head_name(row.sender_layer, row.sender_head)} -> {receiver}"


def name_positions(task, batch) -> dict[str, torch.Tensor]:
    """(n,) positions of the indirect object, the subject's first and second mention, and the last token."""
    found = {"IO": [], "S1": [], "S2": []}
    for i, (tokens, io, s) in enumerate(zip(batch.clean, task.answers, task.distractors)):
        tokens = tokens[: int(batch.last[i]) + 1].tolist()
        found["IO"].append(tokens.index(io[0]))
        subject = [p for p, t in enumerate(tokens) if t == s[0]]
        found["S1"].append(subject[0])
        found["S2"].append(subject[1])
    return {key: torch.tensor(value) for key, value in found.items()} | {"END": batch.last}


def attention_from_end(model, tokens, positions, heads) -> dict:
    """Each head's attention from the last token to IO, S1 and S2, mean over prompts."""
    names = sorted({f"blocks.{l}.attn.hook_pattern" for l, _ in heads})
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=names)
    rows = torch.arange(len(tokens))
    return {(l, h): {key: float(cache[f"blocks.{l}.attn.hook_pattern"][rows, h, positions["END"], positions[key]].mean())
                     for key in ("IO", "S1", "S2")} for l, h in heads}


def writer_queries(model, choose, test, writers) -> None:
    """Path patching by noising from every earlier head into the writers' queries (EAP shortlists,
    exact path patching confirms the top ``SHORTLIST``), then the intervention on the test prompts."""
    paths = shortlist_path_patch(model, choose.clean, choose.corrupted, choose.metric, receivers=writers, via="q",
                                 direction="noise", top_k=SHORTLIST, progress=False)
    ranked = paths.sort_values("effect")
    print(f"\n1. path patching into the writers' queries (noising: the clean run, one sender's write into one "
          f"writer's query input from the corrupted run; clean {choose.clean_value:.2f}, corrupted "
          f"{choose.corrupted_value:.2f}; the {SHORTLIST} edges of largest |EAP| of "
          f"{len(edges_of(model, None, writers, 'q'))}): largest drops")
    for row in ranked.head(8).itertuples():
        print(f"  {edge_name(row)} {row.effect:+.3f} (EAP {row.attribution:+.3f})")
    print("  largest gains:", ", ".join(f"{edge_name(r)} {r.effect:+.3f}" for r in ranked.tail(2)[::-1].itertuples()))
    per_sender = paths.groupby(["sender_layer", "sender_head"])["effect"].sum().sort_values()
    senders = [(int(l), int(h)) for l, h in per_sender.index[:N_SENDERS]]
    print("  senders by their summed effect over the writers:",
          ", ".join(f"{name(h)} {v:+.3f}" for h, v in zip(senders, per_sender.iloc[:N_SENDERS])))
    attention = attention_from_end(model, test.clean, test.positions, senders)
    for head in senders:
        print(f"  {name(head)} attends from the last token (test prompts): "
              + ", ".join(f"{k} {v:.2f}" for k, v in attention[head].items()))

    senders_class = [(int(l), int(h)) for (l, h), total in per_sender.items() if total <= -PATH_MIN]
    control = query_path_control(model, test, writers, senders, exclude=senders_class)
    print(f"  intervention on the test prompts (clean {test.clean_value:.2f}): only the senders' writes into the "
          f"{len(writers)} writers' queries corrupted, against {N_DRAWS} layer-matched random sets (none of the "
          f"{len(senders_class)} heads whose summed path effect is below -{PATH_MIN}): {control.describe()}")


def query_path_control(model, test, writers, senders, exclude=()) -> ControlEffects:
    """The clean run with only ``senders``' writes into the ``writers``' queries taken from the corrupted
    run, against the same cut of ``N_DRAWS`` layer-matched random sets (``matched_random_sets``, none
    of ``exclude``), every circuit scored on the test prompts in one ``circuit_scores`` call (the first
    circuit keeps every edge: the clean run) -> ``ControlEffects`` with every interval over the test
    prompts (``control_from_scores``)."""
    sets = matched_random_sets(model, senders, N_DRAWS, seed=0, exclude=exclude)
    heads = sorted({*senders, *(head for drawn in sets for head in drawn)})
    candidates = edges_of(model, heads, writers, "q")
    frame = candidates.frame()
    sender = list(zip(frame["sender_layer"], frame["sender_head"]))
    kept = [np.array([edge not in set(cut) for edge in sender]) for cut in [[], senders, *sets]]
    scores = circuit_scores(model, test.clean, test.corrupted, test.metric, candidates, kept)
    counts = scores.counts
    clean = PromptScores(scores.values[0], None if scores.numerators is None else scores.numerators[0], counts)
    cut = PromptScores(scores.values[1:], None if scores.numerators is None else scores.numerators[1:], counts)
    return control_from_scores(model, senders, sets, cut, clean, len(test.clean), "corrupted",
                               edit="writes into the writers' queries", exclude=exclude)


def paired_faithfulness(model, test, candidates, orders: dict, sizes, pairs) -> None:
    """Print, for each (a, b) of ``pairs`` (names of ``orders``: rankings of the candidate edges, strongest
    first) and each k of ``sizes``, the faithfulness of a's top-k circuit minus b's on the test prompts
    with the 95% interval of that difference (``paired_difference``: the same prompt resamples for
    both, each faithfulness the pooled (circuit - empty) / (full - empty) numerators)."""
    masks = {}
    for method, order in orders.items():
        for k in sizes:
            mask = np.zeros(len(candidates), dtype=bool)
            mask[order[:k]] = True
            masks[method, k] = mask
    every = [np.ones(len(candidates), dtype=bool), np.zeros(len(candidates), dtype=bool), *masks.values()]
    scores = circuit_scores(model, test.clean, test.corrupted, test.metric, candidates, every)
    full, empty = scores.numerators[0].double(), scores.numerators[1].double()
    kept = dict(zip(masks, scores.numerators[2:].double()))
    print("  faithfulness differences at equal k (95% interval of the paired difference over the test prompts):")
    for a, b in pairs:
        cells = []
        for k in sizes:
            difference = paired_difference(kept[a, k] - empty, full - empty, kept[b, k] - empty, full - empty)
            cells.append(f"k={k} {difference[0]:+.2f} [{difference[1]:+.2f}, {difference[2]:+.2f}]")
        print(f"    {a} - {b}: " + "; ".join(cells))


def rankings(model, choose, candidates_frame) -> dict[str, np.ndarray]:
    """|score| of every candidate edge by each method, in ``edges_of`` order."""
    nodes = sorted({*zip(candidates_frame.sender_layer, candidates_frame.sender_head)})
    common = dict(senders=nodes, receivers=nodes, direction="noise", progress=False)
    exact = path_patch(model, choose.clean, choose.corrupted, choose.metric, **common)
    eap = path_patch(model, choose.clean, choose.corrupted, choose.metric, method="eap", **common)
    eap_ig = path_patch(model, choose.clean, choose.corrupted, choose.metric, method="eap_ig", steps=IG_STEPS, **common)
    return {"exact": exact["effect"].to_numpy(), "EAP": eap["attribution"].to_numpy(),
            "EAP-IG": eap_ig["attribution"].to_numpy(), "frame": exact}


class Half:
    """One half of the prompts as tokens, its metric and its two ends."""

    def __init__(self, model, task):
        batch = task_batch(model, task)
        self.clean, self.corrupted, self.metric = batch.clean, batch.corrupted, task_metric(task, batch.last)
        self.positions = name_positions(task, batch)
        self.abba = int((self.positions["IO"] < self.positions["S1"]).sum())  # the indirect object named first
        with torch.no_grad():
            self.clean_value = self.metric(model(self.clean)).item()
            self.corrupted_value = self.metric(model(self.corrupted)).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=30,
                        help="IOI prompts, half of each template's to choose and half to test (at least 30)")
    parser.add_argument("--nodes", type=int, default=20, help="heads whose edges are the candidates")
    parser.add_argument("--figure", type=Path, default=FIGURE)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load()
    task = ioi_task(model, n=args.prompts, seed=0)
    split = task_split(task, seed=0)  # stratified by template: both halves hold ABBA and BABA prompts
    choose_task, test_task = task.subset(split.selection), task.subset(split.measurement)
    choose, test = Half(model, choose_task), Half(model, test_task)
    print(f"IOI, {len(choose_task)} prompts to choose on ({choose.abba} ABBA; logit difference clean "
          f"{choose.clean_value:.2f}, corrupted {choose.corrupted_value:.2f}), {len(test_task)} to test on "
          f"({test.abba} ABBA; clean {test.clean_value:.2f}, corrupted {test.corrupted_value:.2f})")

    writers = head_writers(model, choose_task)[:N_WRITERS]
    print("answer writers (direct logit attribution, choosing prompts):", ", ".join(map(name, writers)))
    writer_queries(model, choose, test, writers)

    drop = patch_heads(model, choose.clean, choose.corrupted, choose.metric, direction="noise",
                       progress=False) - choose.clean_value
    order = drop.abs().flatten().argsort(descending=True)[:args.nodes].tolist()
    nodes = sorted((i // model.cfg.n_heads, i % model.cfg.n_heads) for i in order)
    print("  largest head-patching changes (noising, choosing prompts):",
          ", ".join(f"{name(divmod(i, model.cfg.n_heads))} {drop.flatten()[i]:+.2f}" for i in order[:8]))
    candidates = edges_of(model, nodes, nodes)
    every = len(edges_of(model))
    print(f"\n2. nodes: the top {args.nodes} heads by |head patching| (noising: each head's output from the corrupted run; {', '.join(map(name, nodes))}); "
          f"{len(candidates)} candidate edges (q/k/v among them, and to the logits), of {every} head edges in all")

    scores = rankings(model, choose, candidates.frame())
    frame = scores.pop("frame")
    top = frame.assign(abs_effect=frame["effect"].abs()).sort_values("abs_effect", ascending=False)
    print("  strongest edges by exact path patching (noising, choosing prompts):",
          ", ".join(f"{edge_name(r)} {r.effect:+.3f}" for r in top.head(6).itertuples()))
    five = int(0.05 * len(candidates))
    sizes = sorted({0, 1, 2, 5, 10, 20, five, 2 * five, 100, 200, len(candidates) // 2, len(candidates)}
                   & set(range(len(candidates) + 1)))
    curves = {method: faithfulness_curve(model, test.clean, test.corrupted, test.metric, candidates,
                                         np.argsort(-np.abs(score), kind="stable"), sizes)
              for method, score in scores.items()}
    curves["exact, signed"] = faithfulness_curve(model, test.clean, test.corrupted, test.metric, candidates,
                                                 np.argsort(scores["exact"], kind="stable"), sizes)
    ends = curves["exact"].attrs
    span = test.clean_value - test.corrupted_value
    print(f"  test prompts: every candidate edge corrupted {ends['empty']:.2f} (clean {ends['full']:.2f}, corrupted "
          f"run {test.corrupted_value:.2f}): the candidate edges carry "
          f"{(ends['full'] - ends['empty']) / span:.0%} of the logit difference")
    print("  faithfulness (top k kept / all but the top k), test prompts:")
    print("    k      " + "".join(f"{method:>18}" for method in curves))
    for i, k in enumerate(sizes):
        print(f"    {k:<6} " + "".join(f"{c['faithfulness'].iloc[i]:>10.2f} / {c['complement'].iloc[i]:>5.2f}"
                                       for c in curves.values()))
    for method in ("exact", "exact, signed"):
        curve = curves[method]
        reached = curve[curve["faithfulness"] >= 0.8]
        at_five = curve[curve["size"] == five].iloc[0]
        print(f"  {method} ranking at 5% ({five} edges): faithfulness {at_five.faithfulness:.2f} "
              f"[{at_five.faithfulness_ci_low:.2f}, {at_five.faithfulness_ci_high:.2f}] "
              f"({(at_five.value - test.corrupted_value) / span:.0%} of the clean - corrupted logit difference), "
              f"complement {at_five.complement:.2f} [{at_five.complement_ci_low:.2f}, "
              f"{at_five.complement_ci_high:.2f}]; 0.8 first reached at k = "
              f"{int(reached['size'].iloc[0]) if len(reached) else 'never'} (95% intervals over the "
              f"{int(at_five.n_prompts)} test prompts)")
    paired_faithfulness(model, test, candidates, {method: np.argsort(-np.abs(score), kind="stable")
                                                  for method, score in scores.items()},
                        [k for k in sizes if 0 < k < len(candidates)], [("EAP-IG", "EAP"), ("exact", "EAP-IG")])
    print(f"\n3. agreement with exact path patching on the {len(candidates)} candidate edges (choosing prompts):")
    for method in ("EAP", "EAP-IG"):
        pair = frame.assign(attribution=scores[method])
        for k in (20, five):
            found = edge_agreement(pair, top_k=k)
            print(f"  {method}: Spearman {found['spearman']:.2f}, Pearson {found['pearson']:.2f}, "
                  f"top-{k} overlap {found['top_k_overlap']:.0%}")
    faithfulness_figure(curves, len(candidates), "SmolLM2-135M IOI: circuits of the top-k candidate edges by each "
                        "ranking (held-out prompts)").savefig(args.figure, dpi=110)
    print(f"figure: {args.figure}")


if __name__ == "__main__":
    main()
