"""A study spec's ``[model].prepend_bos`` (issue 44.6): true or false begins every prompt with the
start token or not, as ``--prepend-bos/--no-prepend-bos`` does; absent, the model's own setting; a
list makes a grid; a bad value is refused in one line naming it. The losses are checked against
Hugging Face's GPT-2 on the tokenizer's own ids."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from analyses.studies.runner import run_study
from analyses.studies.spec import load_spec
from interp import UserError, load_model
from interp.tokenizer import start_token_setting

TEXTS = ("The cat sat on the mat", "A dog ran in the parks")  # 22 bytes each: no padding


def write_spec(directory, model_dir, prepend_line: str):
    (directory / "prompts.txt").write_text("\n".join(TEXTS) + "\n")
    path = directory / "spec.toml"
    path.write_text(f'[model]\nspec = "{model_dir}"\nimpl = "scratch"\n{prepend_line}\n'
                    '[prompts]\nkind = "text"\nfile = "prompts.txt"\n'
                    '[ablation]\nmethod = "zero"\ntargets = [[0, 1]]\n[metric]\nkind = "loss"\n')
    return path


def hf_loss(model_dir, start: bool) -> float:
    """Hugging Face GPT-2's mean next-token loss over the texts' ids, after its BOS when ``start``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    ids = torch.tensor([[tokenizer.bos_token_id] * start + tokenizer(t, add_special_tokens=False)["input_ids"]
                        for t in TEXTS])
    with torch.no_grad():
        logits = hf(ids).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).item()


def test_prepend_bos_sets_the_start_token_of_every_prompt(tmp_path, gpt2_dir):
    """A grid over prepend_bos: each cell's unablated loss is Hugging Face's with and without the
    BOS; the GPT-2 tokenizer's own setting (adding it) is what a spec without the key gets."""
    assert start_token_setting(load_model(str(gpt2_dir), impl="scratch")) == (True, "tokenizer")
    spec = write_spec(tmp_path, gpt2_dir, "prepend_bos = [true, false]")
    assert [cell.spec.prepend_bos for cell in load_spec(spec).cells] == [True, False]
    frame = pd.read_csv(run_study(spec, tmp_path / "grid", progress=False))
    baselines = frame.groupby("cell", sort=False)["baseline"].first()
    with_bos, without = hf_loss(gpt2_dir, True), hf_loss(gpt2_dir, False)
    assert abs(with_bos - without) > 1e-3  # the two inputs differ, so the check below can tell them apart
    assert baselines["prepend_bos=true"] == pytest.approx(with_bos, abs=1e-5)
    assert baselines["prepend_bos=false"] == pytest.approx(without, abs=1e-5)
    default = write_spec(tmp_path, gpt2_dir, "")
    assert load_spec(default).cells[0].spec.prepend_bos is None
    frame = pd.read_csv(run_study(default, tmp_path / "default", progress=False))
    assert frame["baseline"].iloc[0] == pytest.approx(with_bos, abs=1e-5)


@pytest.mark.parametrize("value", ['"yes"', "1"])
def test_a_bad_prepend_bos_is_refused_in_one_line_naming_it(tmp_path, gpt2_dir, value):
    spec = write_spec(tmp_path, gpt2_dir, f"prepend_bos = {value}")
    with pytest.raises(UserError, match=r"^study spec: \[model\].prepend_bos must be true or false, got .*(yes|1)"):
        load_spec(spec)
