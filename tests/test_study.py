"""Scripted studies: the spec's checks, and a killed-and-resumed run giving exactly the rows of an
uninterrupted one."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import analyses.studies.runner
from analyses.core.probes import probes_for
from analyses.studies.runner import read_rows, run_study
from analyses.studies.spec import load_spec
from interp import GPTConfig, GPTModel, UserError, load_model, weights_hash
from interp.loading import save_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def write_spec(directory: Path, model_dir, targets='"each_head"', method="mean", extra="", impl="scratch") -> Path:
    """A study spec in ``directory``; ``impl=None`` leaves [model].impl to its default."""
    path = directory / "spec.toml"
    impl_line = "" if impl is None else f'impl = "{impl}"'
    path.write_text(f"""
[model]
spec = "{model_dir}"
{impl_line}
[prompts]
kind = "repeated"
n = 6
seed = 3
seq_len = 24
[ablation]
method = "{method}"
targets = {targets}
{extra}
[metric]
kind = "repeat_loss"
""")
    return path


class Interrupt(Exception):
    pass


def interrupt_after(k):
    def on_row(index):
        if index + 1 == k:
            raise Interrupt

    return on_row


def ablated_logits(model, tokens, layer: int, heads: list[int], replacement: torch.Tensor | None = None):
    """Naive reference: logits (batch, pos, d_vocab) with ``heads`` of ``layer`` replaced at
    ``hook_z`` by ``replacement`` (batch, pos, head, d_head), or by zeros."""
    def replace(z, hook):  # z: (batch, pos, head, d_head)
        z[:, :, heads] = 0.0 if replacement is None else replacement[:, :, heads]
        return z

    with torch.no_grad():
        return model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", replace)])


def test_rows_match_a_naive_ablation(tmp_path, gpt2_dir):
    results = run_study(write_spec(tmp_path, gpt2_dir), tmp_path / "out", progress=False)
    frame = pd.read_csv(results)
    model = load_model(str(gpt2_dir), impl="scratch").eval()
    probes = probes_for(model, 6, 24, seed=3)
    tokens, counted = probes.tokens, probes.predictable[:, 1:]  # the tokens the repeat loss predicts

    def repeat_loss(logits):
        return F.cross_entropy(logits[:, :-1][counted], tokens[:, 1:][counted]).item()

    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens)
    def others_mean(z):  # mean ablation: each prompt gets the mean of the *other* prompts' outputs
        return (z.sum(dim=0, keepdim=True) - z) / (z.shape[0] - 1)

    heads = [(layer, head) for layer in range(2) for head in range(4)]
    expected = [repeat_loss(ablated_logits(model, tokens, l, [h], others_mean(cache[f"blocks.{l}.attn.hook_z"])))
                for l, h in heads]
    assert list(frame["target"]) == [f"L{l}H{h}" for l, h in heads] and list(frame["row"]) == list(range(8))
    assert frame["metric"].to_numpy() == pytest.approx(expected, abs=1e-5)
    assert frame["baseline"].to_numpy() == pytest.approx([repeat_loss(logits)] * 8, abs=1e-5)
    assert (tmp_path / "out" / "results.png").stat().st_size > 0


@pytest.mark.parametrize("targets", ['"each_head"', '"cumulative"', "[[1, 2], [0, 3]]"])
def test_interrupted_and_resumed_equals_uninterrupted(tmp_path, gpt2_dir, targets):
    spec = write_spec(tmp_path, gpt2_dir, targets, method="resample")
    clean = run_study(spec, tmp_path / "clean", progress=False).read_bytes()
    with pytest.raises(Interrupt):
        run_study(spec, tmp_path / "resumed", progress=False, on_row=interrupt_after(2))
    partial = (tmp_path / "resumed" / "results.csv").read_bytes()
    assert partial.count(b"\n") == 3  # header + the 2 rows written before the failure
    with open(tmp_path / "resumed" / "results.csv", "ab") as handle:
        handle.write(b"2,L0H2,0,2,1,4.7")  # a row torn by the kill, mid-write
    resumed = run_study(spec, tmp_path / "resumed", resume=True, progress=False).read_bytes()
    assert resumed == clean
    assert run_study(spec, tmp_path / "resumed", resume=True, progress=False).read_bytes() == clean  # nothing twice


def kill_at_rows(command: list[str], results: Path, rows: int) -> int:
    """Run ``command`` (a study run) and SIGKILL it once ``results`` holds ``rows`` rows; returns the
    lines (header included) in ``results`` after the kill."""
    process = subprocess.Popen(command, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not results.exists() or results.read_bytes().count(b"\n") <= rows):
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait()
    assert process.returncode == -signal.SIGKILL
    return results.read_bytes().count(b"\n")


def test_killed_subprocess_resumes_without_duplicates(tmp_path, gpt2_dir):
    spec = write_spec(tmp_path, gpt2_dir, '"each_head"', extra="preserve_patterns = true")
    clean = run_study(spec, tmp_path / "clean", progress=False).read_bytes()
    out = tmp_path / "killed"
    results = out / "results.csv"
    # a row every half second at least, so the kill lands mid-run
    code = ("import sys, time; from analyses.studies.runner import run_study; "
            "run_study(sys.argv[1], sys.argv[2], progress=False, on_row=lambda i: time.sleep(0.5))")
    lines = kill_at_rows([sys.executable, "-c", code, str(spec), str(out)], results, 2)
    assert 3 <= lines < 9  # killed mid-run: some rows, not all
    assert run_study(spec, out, resume=True, progress=False).read_bytes() == clean


def test_existing_results_need_resume_and_same_spec(tmp_path, gpt2_dir):
    spec = write_spec(tmp_path, gpt2_dir, '"each_layer"')
    run_study(spec, tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="already exists; pass --resume"):
        run_study(spec, tmp_path / "out", progress=False)
    other = write_spec(tmp_path, gpt2_dir, '"each_layer"', method="zero")
    with pytest.raises(ValueError, match="different spec"):
        run_study(other, tmp_path / "out", resume=True, progress=False)


@pytest.mark.parametrize(
    "body, message",
    [
        ('[ablation]\nmethod = "shuffle"', r"\[ablation\].method is 'shuffle'; allowed: zero, mean"),
        ("[ablation]\ntargets = \"each_head\"", r"\[ablation\].method is missing"),
        ('[ablation]\nmethod = "zero"\ntargets = "each_neuron"', r"\[ablation\].targets is 'each_neuron'"),
        ('[ablation]\nmethod = "zero"\ntargets = [[1]]', r"\[ablation\].targets has \[1\]"),
        ('[ablation]\nmethod = "zero"\nmethd = 1', r"\[ablation\].methd is not a known key"),
        ('[prompts]\nn = "many"\n[ablation]\nmethod = "zero"', r"\[prompts\].n must be an integer, got 'many'"),
        ('[prompts]\nkind = "text"\n[ablation]\nmethod = "zero"', r"\[prompts\].file is missing"),
        ('[modle]\nspec = "toy"', r"\[modle\] is not a known section"),
        ('[model]\nimpl = "jax"', r"\[model\].impl is 'jax'; allowed: auto, scratch, transformer_lens"),
        ('[ablation\nmethod = "zero"', "is not valid TOML"),
        ('[ablation]\nmethod = "zero"\n[metric]\nkind = "logit_diff"', r"\[metric\].correct is missing"),
        ('[ablation]\nmethod = []', r"\[ablation\].method is an empty list; a grid needs at least one value"),
        ('[ablation]\nmethod = ["zero", "zero"]', r"\[ablation\].method lists a value twice"),
        ('[ablation]\nmethod = ["zero", "scramble"]', r"\[ablation\].method is 'scramble'; allowed"),
        ('[run]\nexecutor = ["local", "ray"]\n[ablation]\nmethod = "zero"', r"\[run\].executor must be a str"),
        ('[run]\nexecutor = "spark"\n[ablation]\nmethod = "zero"', r"\[run\].executor is 'spark'; allowed: local, ray"),
        ('[run]\nworkers = 0\n[ablation]\nmethod = "zero"', r"\[run\].workers must be >= 1, got 0"),
        ('[run]\nthreads = 2\n[ablation]\nmethod = "zero"', r"\[run\].threads is not a known key"),
    ],
)
def test_malformed_spec_names_the_key(tmp_path, body, message):
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(ValueError, match=message) as error:
        load_spec(path)
    assert "\n" not in str(error.value)


def test_a_failed_run_leaves_nothing_in_the_way_of_the_corrected_one(tmp_path, gpt2_dir):
    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"\[ablation\].targets: head L5H0 out of range") as error:
        run_study(write_spec(tmp_path, gpt2_dir, "[[5, 0]]"), out, progress=False)
    assert "\n" not in str(error.value)
    assert not (out / "spec.json").exists() and not (out / "results.csv").exists()
    results = run_study(write_spec(tmp_path, gpt2_dir, "[[1, 0], [0, 3]]"), out, resume=True, progress=False)
    assert list(pd.read_csv(results)["target"]) == ["L1H0", "L0H3", "group"]


def test_a_second_run_on_a_directory_in_use_is_refused(tmp_path, gpt2_dir):
    spec, out = write_spec(tmp_path, gpt2_dir, '"each_layer"'), tmp_path / "out"
    refusals = []

    def second_run(index):  # while the first run holds the directory
        with pytest.raises(UserError, match=f"{re.escape(str(out))} is in use by another study run") as error:
            run_study(spec, out, resume=True, progress=False)
        refusals.append(str(error.value))

    results = run_study(spec, out, progress=False, on_row=second_run)
    assert len(refusals) == 2 and all("\n" not in message for message in refusals)
    assert list(pd.read_csv(results)["target"]) == ["L0", "L1"]  # the refused runs appended nothing
    written = results.read_bytes()
    assert run_study(spec, out, resume=True, progress=False).read_bytes() == written  # and the lock is released


HEADER = "row,target,layer,head,n_heads,metric,baseline,effect"


@pytest.mark.parametrize("content, message", [
    (b"name,value\nx,1\ny,2", "not a study of ours"),
    (f"{HEADER}\n0,L0H0,0,0,1,4.5,4.0,0.5\n1,L9H9,9,9,1,4.5,4.0,0.5\n2,L9".encode(), r"row 1 is \['1', 'L9H9'\]"),
    (f"{HEADER}\n0,L0H0,0,0,1,4.5,4.0,0.5\n2,L0H2,0,2,1,4.5,4.0,0.5\n".encode(), "line 3 is row '2' where row 1 was due"),
])
def test_results_that_are_not_ours_are_refused_untouched(tmp_path, gpt2_dir, content, message):
    path = tmp_path / "results.csv"
    path.write_bytes(content)  # each with a torn last line
    study = load_spec(write_spec(tmp_path, gpt2_dir))
    with pytest.raises(UserError, match=message):
        read_rows(path, study).check_cell(None, ["L0H0", "L0H1", "L0H2"])
    assert path.read_bytes() == content


def small_checkpoint(directory: Path, seed: int) -> GPTModel:
    torch.manual_seed(seed)
    model = GPTModel(GPTConfig(d_vocab=257, n_ctx=32, d_model=32, n_heads=4, n_layers=2, attn_only=True)).eval()
    save_checkpoint(model, directory)
    return model


def test_resume_refuses_rows_of_other_weights(tmp_path):
    checkpoint, out = tmp_path / "checkpoint", tmp_path / "out"
    first = small_checkpoint(checkpoint, seed=0)
    spec = write_spec(tmp_path, checkpoint)
    with pytest.raises(Interrupt):
        run_study(spec, out, progress=False, on_row=interrupt_after(2))
    partial = (out / "results.csv").read_bytes()
    second = small_checkpoint(checkpoint, seed=1)  # retrained in place
    with pytest.raises(UserError) as error:
        run_study(spec, out, resume=True, progress=False)
    message = str(error.value)
    assert weights_hash(first) in message and weights_hash(second) in message and "\n" not in message
    assert (out / "results.csv").read_bytes() == partial


def test_resume_refuses_rows_without_a_record_of_their_model(tmp_path, gpt2_dir):
    spec, out = write_spec(tmp_path, gpt2_dir, '"each_layer"'), tmp_path / "out"
    run_study(spec, out, progress=False)
    (out / "provenance.json").unlink()  # as a run of the code before provenance was recorded leaves it
    with pytest.raises(UserError, match="has no provenance.json recording the model its rows came from"):
        run_study(spec, out, resume=True, progress=False)


@pytest.mark.parametrize("impl, asked", [(None, None), ("auto", None), ("scratch", "scratch"),
                                         ("transformer_lens", "transformer_lens")])
def test_impl_auto_is_the_default_and_leaves_the_choice_to_load_model(tmp_path, gpt2_dir, monkeypatch, impl, asked):
    requests = []

    def load(spec, impl, device=None, dtype=None):  # records the impl asked for; loads the scratch model whatever it is
        requests.append(impl)
        return load_model(spec, impl="scratch", device=device)

    monkeypatch.setattr(analyses.studies.cells, "load_model", load)
    run_study(write_spec(tmp_path, gpt2_dir, '"each_layer"', impl=impl), tmp_path / "out", progress=False)
    assert requests == [asked]
    assert json.loads((tmp_path / "out" / "spec.json").read_text())["impl"] == (impl or "auto")
    recorded = json.loads((tmp_path / "out" / "provenance.json").read_text())
    assert recorded["impl"] == "scratch" and recorded["family"] == "gpt2" and recorded["weights_hash"].startswith("sha256:")


def test_example_spec_parses():
    [(name, spec)] = load_spec(ROOT / "examples" / "studies" / "induction_ablation.toml").cells
    assert name is None and (spec.model, spec.method, spec.targets, spec.metric) == ("toy", "mean", "each_head", "repeat_loss")


def test_text_prompts_with_logit_diff(tmp_path, gpt2_dir):
    (tmp_path / "prompts.txt").write_text("The cat sat on the mat\n\nA dog ran in the parks\n")  # 22 bytes each
    spec = tmp_path / "text.toml"
    spec.write_text(f'[model]\nspec = "{gpt2_dir}"\nimpl = "scratch"\n[prompts]\nkind = "text"\nfile = "prompts.txt"\n'
                    '[ablation]\nmethod = "zero"\ntargets = "each_layer"\n'
                    '[metric]\nkind = "logit_diff"\ncorrect = "a"\nincorrect = "b"\n')
    frame = pd.read_csv(run_study(spec, tmp_path / "out", progress=False))
    model = load_model(str(gpt2_dir), impl="scratch").eval()
    tokens = model.to_tokens(["The cat sat on the mat", "A dog ran in the parks"])
    a, b = model.to_tokens("a", prepend_bos=False)[0, 0], model.to_tokens("b", prepend_bos=False)[0, 0]
    expected = [(logits[:, -1, a] - logits[:, -1, b]).mean().item()
                for logits in (ablated_logits(model, tokens, layer, list(range(4))) for layer in range(2))]
    assert list(frame["target"]) == ["L0", "L1"]
    assert frame["metric"].to_numpy() == pytest.approx(expected, abs=1e-5)
    bad = tmp_path / "bad.toml"
    bad.write_text(spec.read_text().replace('correct = "a"', 'correct = "ab"'))
    with pytest.raises(ValueError, match=r"\[metric\].correct: 'ab' is 2 tokens"):
        run_study(bad, tmp_path / "bad_out", progress=False)
    # texts of unequal lengths: each is read at its own last real token, as if run alone
    (tmp_path / "prompts.txt").write_text("The cat sat on the mat\nA dog ran\n")
    ragged = pd.read_csv(run_study(spec, tmp_path / "ragged_out", progress=False))
    alone = [[ablated_logits(model, model.to_tokens(text), layer, list(range(4)))[0, -1] for layer in range(2)]
             for text in ("The cat sat on the mat", "A dog ran")]
    expected = [sum((logits[layer][a] - logits[layer][b]).item() for logits in alone) / 2 for layer in range(2)]
    assert ragged["metric"].to_numpy() == pytest.approx(expected, abs=1e-5)


def test_ragged_text_prompts_count_only_real_tokens(tmp_path, gpt2_dir):
    """Texts of unequal lengths are padded, not cut: the loss is over every real token of each
    text (a naive per-text loss, weighted by its number of predicted tokens)."""
    texts = ["The cat sat on the mat", "A dog ran"]
    (tmp_path / "prompts.txt").write_text("\n".join(texts) + "\n")
    spec = tmp_path / "text.toml"
    spec.write_text(f'[model]\nspec = "{gpt2_dir}"\nimpl = "scratch"\n[prompts]\nkind = "text"\nfile = "prompts.txt"\n'
                    '[ablation]\nmethod = "zero"\ntargets = "each_layer"\n[metric]\nkind = "loss"\n')
    frame = pd.read_csv(run_study(spec, tmp_path / "out", progress=False))
    model = load_model(str(gpt2_dir), impl="scratch").eval()
    for layer, value in enumerate(frame["metric"]):
        losses = []
        for text in texts:
            tokens = model.to_tokens(text)
            logits = ablated_logits(model, tokens, layer, list(range(4)))
            losses.append(torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:], reduction="none"))
        assert value == pytest.approx(torch.cat(losses).mean().item(), abs=1e-5)


def test_a_list_of_one_head_is_one_row(tmp_path, gpt2_dir):
    """A one-head list has no separate 'group' row (it would repeat the head, and its figure's
    pivot crashed on the duplicate)."""
    results = run_study(write_spec(tmp_path, gpt2_dir, targets="[[1, 0]]", method="zero"), tmp_path / "out", progress=False)
    frame = pd.read_csv(results)
    assert list(frame["target"]) == ["L1H0"]
    assert (tmp_path / "out" / "results.png").is_file()


def grid_spec(directory: Path, models: list, methods='["zero", "resample"]') -> Path:
    path = directory / "grid.toml"
    path.write_text(f'[model]\nspec = {json.dumps([str(m) for m in models])}\nimpl = "scratch"\n'
                    f'[prompts]\nn = 6\nseed = 3\nseq_len = 24\n[ablation]\nmethod = {methods}\ntargets = "each_layer"\n')
    return path


def test_a_grid_is_its_cells_studies_one_after_another(tmp_path, gpt2_dir):
    """Each cell's rows are byte for byte the rows of the study it stands for, run alone; cells in
    the order of the keys, then of the values; provenance.json names each cell's model."""
    checkpoint = tmp_path / "checkpoint"
    small_checkpoint(checkpoint, seed=0)
    results = run_study(grid_spec(tmp_path, [gpt2_dir, checkpoint]), tmp_path / "grid", progress=False)
    lines = results.read_text().splitlines()
    assert lines[0] == "cell," + HEADER
    cells = [(model, method) for model in (gpt2_dir, checkpoint) for method in ("zero", "resample")]
    for i, (model, method) in enumerate(cells):
        single = run_study(write_spec(tmp_path, model, '"each_layer"', method=method), tmp_path / f"single{i}",
                           progress=False).read_text().splitlines()
        name = f"spec={model} method={method}"
        assert lines[1 + 2 * i: 3 + 2 * i] == [f"{name},{row}" for row in single[1:]]
    records = json.loads((tmp_path / "grid" / "provenance.json").read_text())["cells"]
    assert records[f"spec={checkpoint} method=zero"]["weights_hash"] == weights_hash(load_model(str(checkpoint)))
    assert records[f"spec={gpt2_dir} method=zero"] == json.loads((tmp_path / "single0" / "provenance.json").read_text())
    assert (tmp_path / "grid" / "results.png").stat().st_size > 0


def test_a_grid_resumes_from_its_last_cell_on_disk(tmp_path, gpt2_dir, monkeypatch):
    """Killed in its second cell, a grid resumes there (the first cell is not prepared again) and
    ends byte-identical to an uninterrupted run."""
    spec = grid_spec(tmp_path, [gpt2_dir, "toy"])
    clean = run_study(spec, tmp_path / "clean", progress=False).read_bytes()
    with pytest.raises(Interrupt):
        run_study(spec, tmp_path / "resumed", progress=False, on_row=interrupt_after(3))  # cell 1, row 0
    with open(tmp_path / "resumed" / "results.csv", "ab") as handle:
        handle.write(f"spec={gpt2_dir} method=resample,1,L".encode())  # torn mid-write
    prepared = []
    prepare = analyses.studies.cells.prepare_study
    monkeypatch.setattr(analyses.studies.cells, "prepare_study", lambda model, cell, **budget: prepared.append(cell.method) or
                        prepare(model, cell, **budget))
    resumed = run_study(spec, tmp_path / "resumed", resume=True, progress=False).read_bytes()
    assert resumed == clean
    assert prepared == ["resample", "zero", "resample"]  # cells 1, 2, 3
    other = grid_spec(tmp_path, [gpt2_dir, "toy"], methods='["zero", "mean"]')
    with pytest.raises(UserError, match="different spec"):
        run_study(other, tmp_path / "resumed", resume=True, progress=False)


def test_grid_cells_are_named_by_their_values(tmp_path):
    path = tmp_path / "grid.toml"
    path.write_text('[run]\nexecutor = "ray"\nworkers = 2\n[prompts]\nseed = [0, 1]\n'
                    '[ablation]\nmethod = "zero"\nseed = [5]\ntargets = ["each_layer", [[1, 4], [0, 2]]]\n')
    study = load_spec(path)
    assert [name for name, _ in study.cells] == [
        f"prompts.seed={p} targets={t} ablation.seed=5" for p in (0, 1) for t in ("each_layer", "[[1, 4], [0, 2]]")]
    assert [(spec.prompt_seed, spec.targets, spec.ablation_seed) for _, spec in study.cells][1] == (0, ((1, 4), (0, 2)), 5)
    assert (study.executor, study.workers, study.address) == ("ray", 2, None)
    path.write_text('[ablation]\nmethod = "zero"\ntargets = [[1, 4], [0, 2]]\n')  # a list of heads: one value
    assert [name for name, _ in load_spec(path).cells] == [None]


def text_spec(directory: Path, model_dir, prompts_file: str = "prompts.txt") -> Path:
    spec = directory / "text.toml"
    spec.write_text(f'[model]\nspec = "{model_dir}"\nimpl = "scratch"\n[prompts]\nkind = "text"\n'
                    f'file = "{prompts_file}"\n[ablation]\nmethod = "zero"\ntargets = "each_head"\n'
                    '[metric]\nkind = "loss"\n')
    return spec


def test_resume_refuses_an_edited_prompt_file_naming_it(tmp_path, gpt2_dir):
    """The spec names the prompt file by its path: a resume after the file changed would append rows
    of other prompts (another baseline) to the rows on disk, so the file's contents are recorded."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The cat sat on the mat\nA dog ran in the parks\n")
    spec = text_spec(tmp_path, gpt2_dir)
    with pytest.raises(Interrupt):
        run_study(spec, tmp_path / "out", progress=False, on_row=interrupt_after(3))
    prompts.write_text("Birds fly south in winter\nA dog ran in the parks\n")
    with pytest.raises(UserError, match=r"different spec or prompt file \(text_file_sha256 was '[0-9a-f]{64}', "
                                        r"now '[0-9a-f]{64}'; see ") as error:
        run_study(spec, tmp_path / "out", resume=True, progress=False)
    assert "\n" not in str(error.value)
    assert len(pd.read_csv(tmp_path / "out" / "results.csv")) == 3  # nothing appended
    prompts.write_text("The cat sat on the mat\nA dog ran in the parks\n")  # the same bytes again: resumes
    frame = pd.read_csv(run_study(spec, tmp_path / "out", resume=True, progress=False))
    assert len(frame) == 8 and frame["baseline"].nunique() == 1


def test_a_spec_and_a_prompt_file_with_a_byte_order_mark_read_as_without(tmp_path, gpt2_dir):
    """Notepad and spreadsheets start UTF-8 files with U+FEFF: not a prompt's first character, nor TOML."""
    (tmp_path / "plain.txt").write_text("The cat sat\nA dog ran\n", encoding="utf-8")
    (tmp_path / "marked.txt").write_text("The cat sat\nA dog ran\n", encoding="utf-8-sig")
    from analyses.core.tokens import read_text_lines

    assert read_text_lines(tmp_path / "marked.txt", "text file") == ["The cat sat", "A dog ran"]
    plain = pd.read_csv(run_study(text_spec(tmp_path, gpt2_dir, "plain.txt"), tmp_path / "plain", progress=False))
    spec = text_spec(tmp_path, gpt2_dir, "marked.txt")
    spec.write_text(spec.read_text(), encoding="utf-8-sig")
    marked = pd.read_csv(run_study(spec, tmp_path / "marked", progress=False))
    assert marked["metric"].tolist() == plain["metric"].tolist()


@pytest.mark.parametrize("targets", ['"each_head"', '"cumulative"'])
def test_a_studys_memory_budget_reaches_every_forward(tmp_path, gpt2_dir, monkeypatch, targets):
    """Ray sizes a study's actors by ``[run].memory_mb``, so the unablated run, the rows' forwards
    and a cumulative study's importance (its forward and backward) must all be chunked within it,
    not within the 1024 MB default. Every chunked analysis sizes its chunks by ``rows_within``:
    each budget it was asked about is counted."""
    import analyses.core.budget
    import analyses.interventions.engine
    import analyses.interventions.run
    from analyses.studies.cells import StudyCells

    asked = []

    def counted(model, n_pos, memory_mb, **sizes):
        asked.append(memory_mb)
        return analyses.core.budget.rows_within(model, n_pos, memory_mb, **sizes)

    for module in (analyses.interventions.engine, analyses.interventions.run):
        monkeypatch.setattr(module, "rows_within", counted)
    study = load_spec(write_spec(tmp_path, gpt2_dir, targets=targets, method="mean"))
    cells = StudyCells(study.cells, memory_mb=3.0)
    plan = cells.plan(0)
    rows = list(cells.rows(0, 0, len(plan.targets)))
    assert len(rows) == len(plan.targets) and len(asked) > len(rows) // 8
    assert set(asked) == {3.0}


def test_a_relative_model_path_is_the_spec_files_wherever_the_study_runs_from(tmp_path, monkeypatch):
    """Issue 43.9: ``[model].spec = "models/m"`` is ``models/m`` beside the spec, as ``[prompts].file``
    is; run from another directory holding a different ``models/m``, the study loads the spec's
    model (same weights hash) and writes the same rows."""
    specs, elsewhere = tmp_path / "specs", tmp_path / "elsewhere"
    model = load_model("toy")
    save_checkpoint(model, specs / "models" / "m")
    with torch.no_grad():
        model.blocks[0].attn.W_value.weight.mul_(-1.0)  # a different model of the same shape and name
    save_checkpoint(model, elsewhere / "models" / "m")
    spec = specs / "spec.toml"
    spec.write_text('[model]\nspec = "models/m"\n[prompts]\nn = 2\nseq_len = 16\n'
                    '[ablation]\nmethod = "zero"\ntargets = "each_layer"\n')
    results, hashes = [], []
    for cwd in (specs, elsewhere):
        monkeypatch.chdir(cwd)
        out = tmp_path / f"out-{cwd.name}"
        results.append(pd.read_csv(run_study(Path("..") / "specs" / "spec.toml", out, progress=False)))
        hashes.append(json.loads((out / "provenance.json").read_text())["weights_hash"])
    assert hashes[0] == hashes[1] == weights_hash(load_model(str(specs / "models" / "m")))
    pd.testing.assert_frame_equal(results[0], results[1])


def test_a_model_value_that_is_no_path_beside_the_spec_stays_a_name_unless_the_cwd_holds_it(tmp_path, monkeypatch):
    """Names (toy) and hub ids stay as written, even beside a same-named directory; a value that is
    no path beside the spec but one in the current directory is refused, not silently loaded."""
    specs, cwd = tmp_path / "specs", tmp_path / "cwd"
    (specs / "toy").mkdir(parents=True)
    (cwd / "gpt2").mkdir(parents=True)
    monkeypatch.chdir(cwd)
    spec = specs / "spec.toml"
    for value in ("toy", "EleutherAI/pythia-70m"):
        spec.write_text(f'[model]\nspec = "{value}"\n[ablation]\nmethod = "zero"\n')
        assert load_spec(spec).cells[0].spec.model == value
    spec.write_text('[model]\nspec = "./m"\n[ablation]\nmethod = "zero"\n')  # path syntax: the spec's, existing or not
    assert load_spec(spec).cells[0].spec.model == str(specs / "m")
    spec.write_text('[model]\nspec = "gpt2"\n[ablation]\nmethod = "zero"\n')
    with pytest.raises(UserError, match=r"^study spec: \[model\].spec 'gpt2' is no path under the spec's directory "
                                        r".*specs, but is one under the current directory; relative paths are read "
                                        r"from the spec's directory"):
        load_spec(spec)
