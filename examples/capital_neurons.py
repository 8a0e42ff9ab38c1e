"""MLP neurons on SmolLM2 (issue 37.2; the numbers in docs/guides/components.md, "MLP neurons"): which
MLP matters for naming a country's capital, which of its neurons, what each promotes through the
unembedding, confirmed by ablating it on each prompt.

    OMP_NUM_THREADS=1 .venv/bin/python examples/capital_neurons.py [--model smollm2] [--layer 23]
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch

from analyses import logit_diff_metric, mlp_ablation, neuron_effects, promoted_tokens, promotion_effects
from interp import load_model

COUNTRIES = ["France", "Italy", "Japan", "Germany", "Spain", "Russia"]
CAPITALS = [" Paris", " Rome", " Tokyo", " Berlin", " Madrid", " Moscow"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--layer", type=int, help="the MLP to read (default: the one whose ablation costs most)")
    parser.add_argument("--top", type=int, default=5, help="neurons to read and confirm (default 5)")
    args = parser.parse_args()
    model = load_model(args.model).eval()
    prompts = [f"The capital city of {country} is the city of" for country in COUNTRIES]
    tokens = model.to_tokens(prompts)
    correct = torch.tensor([model.tokenizer.encode(capital)[0] for capital in CAPITALS])
    metric = logit_diff_metric(correct, correct.roll(1))  # each capital against the next prompt's
    with torch.no_grad():
        print(f"clean logit difference {float(metric(model(tokens))):.2f}")
        mlps = mlp_ablation(model, tokens, metric, method="mean").sort_values("effect")
    print(mlps.head(6).to_string(index=False))
    layer = int(mlps["layer"].iloc[0]) if args.layer is None else args.layer
    frame = neuron_effects(model, tokens, metric, layer, method="mean", exact=20)
    checked = frame.dropna()
    print(checked.head(10).to_string(index=False))
    print(f"Spearman(attribution, exact effect) over {len(checked)}: "
          f"{checked[['attribution', 'effect']].corr(method='spearman').iloc[0, 1]:.3f}")
    neurons = [int(n) for n in checked.sort_values("effect")["neuron"][:args.top]]
    print(promoted_tokens(model, layer, neurons, k=6).groupby("neuron")["token"].apply(list).to_string())
    per_prompt = pd.concat([promotion_effects(model, [prompt], layer, neurons, k=10, method="zero").assign(country=country)
                            for country, prompt in zip(COUNTRIES, prompts)])
    for value in ("activation", "promotion"):
        print(per_prompt.pivot(index="neuron", columns="country", values=value).round(2).to_string())


if __name__ == "__main__":
    main()
