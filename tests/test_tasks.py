"""Tasks as data: generators for any tokenizer, custom files, and task metrics checked against a
naive per-prompt computation."""

import json
import types

import pytest
import torch

from analyses.tasks.task import (
    NAMES, Task, greater_than_task, induction_text_task, ioi_task, load_task, make_task, task_batch, task_metric,
)
from analyses.core.tokens import encode
from interp import UserError, load_model
from interp.random_models import make_random_gpt2
from interp.convert import from_hf


@pytest.fixture(scope="module")
def toy():
    return load_model("toy")


@pytest.fixture(scope="module")
def bpe_model():
    """A stand-in model (tokenizer + cfg) whose byte-level BPE was trained here on text with names and
    numbers, so " Mary" or "32" is one token while rare names are not."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([  # digits in pairs, as GPT-2 splits "1732" into "17" "32"
        pre_tokenizers.Split(Regex(r"\d\d"), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    core.decoder = decoders.ByteLevel()
    common = NAMES[:30]  # the last ten names stay rare: never seen in training, so split into pieces
    text = [f"When {a} and {b} went to the store, {b} gave a drink to {a}." for a in common for b in common]
    text += [f"The war lasted from the year 17{y:02d} to the year 17{(y + 3) % 100:02d}." for y in range(100)] * 5
    text += ["The " + w + " lasted" for w in ("dynasty", "siege", "drought", "strike")] * 20
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(text, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    cfg = types.SimpleNamespace(n_ctx=128, d_vocab=len(hf))
    return types.SimpleNamespace(tokenizer=hf, cfg=cfg)


def test_ioi_keeps_single_token_names_in_both_orders_with_an_abc_corruption(bpe_model):
    hf = bpe_model.tokenizer
    task = ioi_task(bpe_model, n=30, seed=1)
    single = [name for name in NAMES if len(hf.encode(" " + name)) == 1]
    assert 5 <= len(single) < len(NAMES)
    assert task.dropped >= len(NAMES) - len(single) and not task.note
    orders = set()
    for clean, corrupted, (answer,), (subject,) in zip(task.clean, task.corrupted, task.answers, task.distractors):
        io, s = hf.decode([answer]).strip(), hf.decode([subject]).strip()
        assert io in single and s in single and io != s
        assert clean.count(s) == 2 and clean.count(io) == 1 and clean.endswith(" to")
        first = clean.index(io) < clean.index(s)
        orders.add("ABBA" if first else "BABA")
        names = [n for n in NAMES if f" {n} " in f" {corrupted.replace(',', ' ').replace('.', ' ')} "]
        assert io not in names and s not in names and len(set(names)) == 3  # A, B, C: no name repeats
        assert len(hf.encode(clean)) == len(hf.encode(corrupted))
    assert orders == {"ABBA", "BABA"}


def test_greater_than_answers_are_the_later_years_and_the_corruption_is_01(bpe_model):
    hf = bpe_model.tokenizer
    task = greater_than_task(bpe_model, n=20, seed=2)
    assert task.metric == "prob_diff" and not task.note
    for clean, corrupted, answers, distractors in zip(task.clean, task.corrupted, task.answers, task.distractors):
        year = int(clean.split("the year 17")[1][:2])
        assert corrupted == clean.replace(f"17{year:02d}", "1701", 1)
        assert sorted(int(hf.decode([t])) for t in answers) == [y for y in range(year + 1, 100)
                                                                 if len(hf.encode(f"{y:02d}")) == 1]
        assert all(int(hf.decode([t])) <= year for t in distractors)


def test_a_byte_tokenizer_falls_back_to_letters_and_decades_and_says_so(toy):
    ioi = ioi_task(toy, n=10)
    assert ioi.dropped >= len(NAMES) and "single capital letters" in ioi.note
    assert all(len(c) == len(b) and c.endswith("to ") for c, b in zip(ioi.clean, ioi.corrupted))
    assert all(chr(a[0]).isupper() for a in ioi.answers)
    gt = greater_than_task(toy, n=10)
    assert gt.dropped == 100 and "one digit stands in" in gt.note  # tests/test_greater_than_measures.py: which


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tokenizer", ["toy", "bpe_model"])
def test_induction_text_repeats_its_sentence_and_no_corruption_keeps_the_answer_copyable(tokenizer, seed, request):
    """The clean prompt is a sentence, then its first half again; the answer is the next word's
    first token. The corrupted first copy is a permutation of the sentence's words in which the
    prompt's last word is never followed by the answer word (else the corrupted run can still copy
    the answer, and every normalised effect is diluted)."""
    from analyses.core.tokens import model_tokenizer

    model = request.getfixturevalue(tokenizer)
    decode = model_tokenizer(model).decode
    task = induction_text_task(model, seed=seed)
    assert len(task) + task.dropped == 16 and len(task) >= 8
    for clean, corrupted, (answer,), (distractor,) in zip(task.clean, task.corrupted, task.answers, task.distractors):
        first, second = clean.split(". ")
        words, repeat = first.split(), second.split()
        assert words[: len(repeat)] == repeat and len(repeat) == len(words) // 2
        answer_word, last_word = words[len(repeat)], repeat[-1]
        assert answer_word.startswith(decode([answer]).strip()) and decode([answer]).strip()
        assert answer != distractor and words[len(repeat) - 2].startswith(decode([distractor]).strip())
        shuffled, corrupted_repeat = (part.split() for part in corrupted.split(". "))
        assert sorted(shuffled) == sorted(words) and corrupted_repeat == repeat
        everything = shuffled + corrupted_repeat
        assert (last_word, answer_word) not in zip(everything, everything[1:]), (clean, corrupted)


def naive_value(model, task: Task) -> float:
    """One unpadded forward per prompt, the metric by hand at its last token, then the mean."""
    values = []
    for prompt, good, bad in zip(task.clean, task.answers, task.distractors):
        ids = encode(model, prompt).tokens  # one prompt: no padding
        with torch.no_grad():
            last = model(ids)[0, -1].double()
        if task.metric == "prob_diff":
            probs = last.softmax(-1)
            values.append(float(sum(probs[t] for t in good) - sum(probs[t] for t in bad)))
        else:
            values.append(float(sum(last[t] for t in good) / len(good) - sum(last[t] for t in bad) / len(bad)))
    return sum(values) / len(values)


@pytest.mark.parametrize("make", [ioi_task, greater_than_task, induction_text_task])
def test_task_metrics_equal_a_naive_per_prompt_computation_on_a_ragged_batch(make):
    model = from_hf(*make_random_gpt2(n_ctx=128, seed=4))
    task = make(model)
    batch = task_batch(model, task)
    if make is not greater_than_task:
        assert len(set(batch.last.tolist())) > 1  # prompts of different lengths share the padded batch
    with torch.no_grad():
        value = task_metric(task, batch.last)(model(batch.clean)).item()
    assert value == pytest.approx(naive_value(model, task), abs=1e-5)
    # in chunks of prompts (what an intervention within a memory budget runs), each part given the
    # logits of its own prompts at the read positions only: the weighted parts are the batch's value
    metric = task_metric(task, batch.last)
    read, parts = metric.read_positions, [slice(0, 1), slice(1, len(task) // 2), slice(len(task) // 2, len(task))]
    with torch.no_grad():
        logits = model(batch.clean)[:, read]
    found = [metric.part(rows, read) for rows in parts]
    assert [weight for _, weight in found] == [rows.stop - rows.start for rows in parts]
    assert sum(weight * part(logits[rows]).item() for (part, weight), rows in zip(found, parts)) / len(task) == (
        pytest.approx(naive_value(model, task), abs=1e-5))


def test_the_metric_reads_only_the_positions_it_declares(toy):
    task = ioi_task(toy, n=8)
    batch = task_batch(toy, task)
    metric = task_metric(task, batch.last)
    with torch.no_grad():
        logits = toy(batch.clean)
    masked = torch.full_like(logits, torch.nan)
    masked[:, metric.read_positions] = logits[:, metric.read_positions]
    assert metric(masked).item() == pytest.approx(metric(logits).item())


def test_unequal_clean_and_corrupted_lengths_are_refused_naming_the_pair(toy):
    task = Task("t", ("ab", "abc"), ("xy", "x"), ((97,), (98,)), ((99,), (100,)))
    with pytest.raises(UserError, match="prompt 1: the clean prompt is 4 tokens but the corrupted one is 2"):
        task_batch(toy, task)
    with pytest.raises(UserError, match="unknown task metric 'kl'"):
        Task("t", ("a",), ("b",), ((1,),), ((2,),), metric="kl")


def test_a_custom_jsonl_or_csv_task_loads_with_the_same_fields(toy, tmp_path):
    rows = [{"clean": "x = 1; print(x", "corrupted": "x = [; print(x", "answer": ")", "distractor": ["]", "}"]},
            {"clean": "a = {b", "corrupted": "a = (b", "answer": "}", "distractor": ")"}]
    jsonl = tmp_path / "brackets.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    csv = tmp_path / "brackets.csv"
    csv.write_text("clean,corrupted,answer,distractor\n\"x = 1; print(x\",\"x = [; print(x\",),]|}\na = {b,a = (b,},)\n")
    for path in (jsonl, csv):
        task = make_task(toy, str(path))
        assert task.name == "brackets" and task.clean == ("x = 1; print(x", "a = {b")
        assert task.answers == ((ord(")"),), (ord("}"),)) and task.distractors == ((ord("]"), ord("}")), (ord(")"),))


def test_whitespace_answers_that_are_one_token_load(toy, tmp_path):
    """A code task's answer may be a space or a newline: any non-empty text that is one token there."""
    path = tmp_path / "spaces.jsonl"
    path.write_text('{"clean": "if x:", "corrupted": "if y:", "answer": "\\n", "distractor": " "}\n')
    task = load_task(toy, path)
    assert task.answers == ((ord("\n"),),) and task.distractors == ((ord(" "),),)
    path.write_text('{"clean": "if x:", "corrupted": "if y:", "answer": "", "distractor": " "}\n')
    with pytest.raises(UserError, match="row 1: missing answer"):
        load_task(toy, path)


def test_a_task_file_saved_with_a_byte_order_mark_loads_as_without(toy, tmp_path):
    """A spreadsheet's "CSV UTF-8" (and Notepad) start the file with U+FEFF."""
    text = {"csv": "clean,corrupted,answer,distractor\na = {b,a = (b,},)\n",
            "jsonl": '{"clean": "a = {b", "corrupted": "a = (b", "answer": "}", "distractor": ")"}\n'}
    for suffix, body in text.items():
        plain, marked = tmp_path / f"plain.{suffix}", tmp_path / f"marked.{suffix}"
        plain.write_text(body, encoding="utf-8")
        marked.write_text(body, encoding="utf-8-sig")
        assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
        assert load_task(toy, marked).clean == load_task(toy, plain).clean == ("a = {b",)
    (tmp_path / "latin.csv").write_bytes("clean,corrupted,answer,distractor\n\u00e9,e,},)\n".encode("latin-1"))
    with pytest.raises(UserError, match="is not UTF-8 text"):
        load_task(toy, tmp_path / "latin.csv")


@pytest.mark.parametrize("line, message", [
    ('{"clean": "ab", "corrupted": "cd", "answer": "e"}', "brackets.jsonl, row 2: missing distractor"),
    ('{"clean": "ab", "corrupted": "cd", "answer": "ef", "distractor": "g"}',
     "row 2: answer 'ef' is not a single token after the clean prompt"),
    ('{"clean": "ab", "corrupted": "cde", "answer": "e", "distractor": "g"}',
     "row 2: clean and corrupted prompts have different token lengths"),
    ('{"clean": "ab", ', "brackets.jsonl, row 2: not JSON"),
    ('["ab"]', "row 2: a row must be an object"),
])
def test_a_malformed_row_is_refused_in_one_line_naming_it(toy, tmp_path, line, message):
    path = tmp_path / "brackets.jsonl"
    path.write_text('{"clean": "ab", "corrupted": "cd", "answer": "e", "distractor": "f"}\n' + line + "\n")
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("[", r"\[")) as error:
        load_task(toy, path)
    assert "\n" not in str(error.value)


def test_unknown_task_names_and_suffixes_are_refused(toy, tmp_path):
    with pytest.raises(UserError, match="unknown task 'iio'; allowed: ioi, greater-than, induction-text, brackets, identifier"):
        make_task(toy, "iio")
    (tmp_path / "t.csv").write_text("clean,corrupted\n")
    with pytest.raises(UserError, match="^t.csv: the header lacks answer, distractor; it needs clean, corrupted, answer, "
                                        "distractor, and has 'clean', 'corrupted'$"):
        make_task(toy, str(tmp_path / "t.csv"))


# ------------------------------------------------------------------------------ interp task
def read_csv(path):
    import pandas as pd

    return pd.read_csv(path, keep_default_na=False, na_values=[""])


def naive_patch(model, batch, metric, layer: int, head: int, pos: int | None = None) -> float:
    """The metric on the corrupted prompts with one head's ``hook_z`` (at ``pos``, else at every
    position) taken from the clean run: two plain forwards and a hand-written hook."""
    name = f"blocks.{layer}.attn.hook_z"
    _, clean = model.run_with_cache(batch.clean, names_filter=name)
    where = slice(None) if pos is None else pos

    def patch(z, hook):  # z: (batch, pos, head, d_head)
        z = z.clone()
        z[:, where, head] = clean[name][:, where, head]
        return z

    with torch.no_grad():
        return metric(model.run_with_hooks(batch.corrupted, fwd_hooks=[(name, patch)])).item()


def test_the_task_page_shows_the_library_functions_numbers(toy, tmp_path):
    from analyses.cli import main
    from analyses.circuits.path_patching import path_patch

    out = tmp_path / "ioi"
    assert main(["task", "ioi", "--n", "6", "--top", "2", "--exact-all", "--no-split", "--out", str(out), "--quiet"]) == 0
    task = make_task(toy, "ioi", n=6)
    batch = task_batch(toy, task)
    metric = task_metric(task, batch.last)
    with torch.no_grad():
        clean, corrupted = metric(toy(batch.clean)).item(), metric(toy(batch.corrupted)).item()
    assert read_csv(out / "metric.csv")["metric"].tolist() == pytest.approx([clean, corrupted, clean - corrupted],
                                                                           abs=1e-6)
    n_layers, n_heads, n_pos = toy.cfg.n_layers, toy.cfg.n_heads, batch.clean.shape[1]
    heads = read_csv(out / "heads.csv")
    by_pos = read_csv(out / "heads_by_pos.csv")
    assert list(zip(heads["layer"], heads["head"])) == [(l, h) for l in range(n_layers) for h in range(n_heads)]
    assert list(zip(by_pos["layer"], by_pos["pos"], by_pos["head"])) == [
        (l, p, h) for l in range(n_layers) for p in range(n_pos) for h in range(n_heads)]
    for (layer, head), value in zip(zip(heads["layer"], heads["head"]), heads["metric"]):
        assert value == pytest.approx(naive_patch(toy, batch, metric, layer, head), abs=1e-5)
    for layer, pos, head in [(0, n_pos - 1, 0), (n_layers - 1, n_pos - 1, n_heads - 1), (n_layers - 1, 2, 1)]:
        row = by_pos[(by_pos["layer"] == layer) & (by_pos["pos"] == pos) & (by_pos["head"] == head)]
        assert row["metric"].item() == pytest.approx(naive_patch(toy, batch, metric, layer, head, pos), abs=1e-5)
    edges = read_csv(out / "edges.csv")
    senders = sorted(set(zip(edges["sender_layer"], edges["sender_head"])))
    expected = path_patch(toy, batch.clean, batch.corrupted, metric, senders=senders)
    assert edges["effect"].to_numpy() == pytest.approx(expected["effect"].to_numpy(), abs=1e-6)
    # direct logit attribution adds up to the clean logit difference (the components sum to the logits)
    assert read_csv(out / "dla.csv")["dla"].sum() == pytest.approx(clean, abs=1e-4)
    page = (out / "index.html").read_text()
    assert f"{clean:.4f}" in page and "Direct logit attribution" in page and "Circuit" in page
    assert "http://" not in page.split("<script>")[0] and "https://" not in page.split("<script>")[0]
    assert "Every cell measured exactly" in page and "Screened" not in page
    assert json.loads((out / "meta.json").read_text())["screen"]["exact"] == "every cell and edge"
    assert all(read_csv(out / name)["exact"].all() for name in ("heads.csv", "heads_by_pos.csv", "edges.csv"))


def screen_rule(effect: torch.Tensor, gap: float, top_k: int = 20, share: float = 0.02) -> torch.Tensor:
    """What the default screen says it measures exactly, written out: the ``top_k`` cells of largest
    |estimated effect| and every cell whose |estimated effect| reaches ``share`` x |gap|."""
    size = effect.abs().flatten()
    chosen = size >= share * abs(gap)
    chosen[torch.topk(size, top_k).indices] = True
    return chosen


def test_the_screened_page_measures_exactly_the_cells_its_rule_names_and_says_so(toy, tmp_path):
    """At its defaults ``interp task`` screens: the cells (edges) measured exactly are the rule's,
    computed here from attribution patching (EAP); each equals the exhaustive sweep (path patching)
    to 1e-5, every other cell holds the estimate; the page and meta.json name the rule."""
    from analyses.cli import main
    from analyses.circuits.path_patching import edge_attribution, path_patch
    from analyses.interventions.patching import patch_heads

    out = tmp_path / "ioi"
    assert main(["task", "ioi", "--n", "6", "--top", "2", "--no-split", "--out", str(out), "--quiet"]) == 0
    task = make_task(toy, "ioi", n=6)
    batch = task_batch(toy, task)
    metric = task_metric(task, batch.last)
    pair = (toy, batch.clean, batch.corrupted, metric)
    with torch.no_grad():
        clean, corrupted = metric(toy(batch.clean)).item(), metric(toy(batch.corrupted)).item()
    estimate = patch_heads(*pair, by_position=True, method="attribution").flatten()
    exhaustive = patch_heads(*pair, by_position=True).flatten()
    by_pos = read_csv(out / "heads_by_pos.csv")
    chosen = screen_rule(estimate - corrupted, clean - corrupted)
    assert by_pos["exact"].tolist() == chosen.tolist() and 20 <= chosen.sum() < len(chosen) / 4
    values = torch.tensor(by_pos["metric"].to_numpy(), dtype=torch.float32)
    torch.testing.assert_close(values[chosen], exhaustive[chosen], atol=1e-5, rtol=0)
    torch.testing.assert_close(values[~chosen], estimate[~chosen], atol=1e-5, rtol=0)
    # the top heads by exact patching are the exhaustive sweep's (the senders of path patching)
    heads = read_csv(out / "heads.csv")
    assert heads["exact"].all()  # 16 heads: every one is among the top 20
    torch.testing.assert_close(torch.tensor(heads["metric"].to_numpy(), dtype=torch.float32),
                               patch_heads(*pair).flatten(), atol=1e-5, rtol=0)
    edges = read_csv(out / "edges.csv")
    senders = sorted(set(zip(edges["sender_layer"], edges["sender_head"])))
    attributed = torch.tensor(edge_attribution(*pair, senders=senders)["attribution"].to_numpy(), dtype=torch.float32)
    exact = torch.tensor(path_patch(*pair, senders=senders)["effect"].to_numpy(), dtype=torch.float32)
    chosen = screen_rule(attributed, clean - corrupted)
    effect = torch.tensor(edges["effect"].to_numpy(), dtype=torch.float32)
    assert edges["exact"].tolist() == chosen.tolist() and chosen.sum() < len(chosen)
    torch.testing.assert_close(effect[chosen], exact[chosen], atol=1e-5, rtol=0)
    torch.testing.assert_close(effect[~chosen], attributed[~chosen], atol=1e-5, rtol=0)
    meta = json.loads((out / "meta.json").read_text())["screen"]
    assert (meta["top_k"], meta["share"]) == (20, 0.02)
    assert meta["exact_of_all"]["heads_by_pos"] == [int(by_pos["exact"].sum()), len(by_pos)]
    page = (out / "index.html").read_text()
    assert "Screened by attribution" in page and "Screened by EAP" in page and meta["rule"] in page


def test_a_screen_that_is_no_rule_is_refused_in_one_line(tmp_path, capsys):
    from analyses.cli import main

    for option, value in (("--screen-top", "-1"), ("--screen-share", "0")):
        with pytest.raises(SystemExit):  # by the parser (tests/test_cli_arguments.py)
            main(["task", "ioi", option, value, "--out", str(tmp_path / "out")])
        error = capsys.readouterr().err.splitlines()[-1]
        assert error.startswith(f"interp task: error: argument {option}: {value} is not a")


def test_dla_averages_answer_and_distractor_sets_and_adds_up_to_the_metric(toy):
    from analyses.report.task_page import task_dla

    task = Task("sets", ("x = (1", "y = [2, 3"), ("x = [1", "y = (2, 3"), ((ord(")"), ord("]")), (ord("]"),)),
                ((ord("}"),), (ord(")"), ord("}"), ord(">"))))
    batch = task_batch(toy, task)
    with torch.no_grad():
        value = task_metric(task, batch.last)(toy(batch.clean)).item()
    assert task_dla(toy, task, batch)["dla"].sum() == pytest.approx(value, abs=1e-4)


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "qwen2", "gemma", "gpt_neox", "phi", "opt", "gpt_neo"])
def test_a_custom_task_runs_on_every_family(family, family_dir, tmp_path):
    from analyses.report.task_page import analyse_task, write_task_page

    model = load_model(family_dir(family))
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"clean": "ab ab a", "corrupted": "cd ab a", "answer": "b", "distractor": "d"}\n'
                    '{"clean": "xy xy x", "corrupted": "zw xy x", "answer": "y", "distractor": "w"}\n')
    task = load_task(model, path)
    analysis = analyse_task(model, task, top=2, split=False, progress=False)
    out = write_task_page(analysis, tmp_path / "page", {"model": family})
    assert read_csv(out / "heads.csv")["metric"].to_numpy() == pytest.approx(analysis.heads["metric"].to_numpy(), abs=1e-6)
    # 2 layers x 8 positions: 7 tokens of text and the start token where the family's tokenizer adds one
    assert len(analysis.mlps_by_pos) == 2 * (7 + model.cfg.default_prepend_bos)
    # scored, except on the TransformerLens bridges (opt, gpt_neo), whose attention takes no per-head
    # q/k/v input and which EAP-IG cannot start at block 0: said on the page
    refusals = {"attribution": "cannot split its q/k/v inputs per head", "attribution_ig": "which needs a GPTModel"}
    for column, refusal in refusals.items():
        found = analysis.agreement[column]
        if family in ("opt", "gpt_neo"):
            assert refusal in found["refused"] and column not in analysis.edges
        else:
            assert "refused" not in found, found
            assert -1 <= found["spearman"] <= 1 and analysis.edges[column].abs().max() > 0
    assert analysis.dla["dla"].sum() == pytest.approx(analysis.values["clean"], abs=1e-3)


@pytest.mark.parametrize("name", ["greater-than", "induction-text"])
def test_the_other_built_in_tasks_run_as_commands(toy, tmp_path, name, capsys):
    from analyses.cli import main

    out = tmp_path / name
    assert main(["task", name, "--n", "3", "--top", "1", "--no-split", "--out", str(out), "--quiet"]) == 0
    task = make_task(toy, name, n=3)
    assert f"{name}: {len(task)} prompts ({task.dropped} dropped)" in capsys.readouterr().out
    assert (out / "dla.csv").exists() == (task.metric == "logit_diff")  # no DLA of a probability difference
    assert main(["task", "nope", "--out", str(tmp_path / "nope")]) == 2
    assert "unknown task 'nope'" in capsys.readouterr().err


def test_code_tasks_close_the_open_bracket_and_recall_the_defined_name(toy, bpe_model):
    from analyses.tasks.task import BRACKETS, brackets_task, identifier_task

    task = brackets_task(toy)
    assert len(task) == 36 and task.dropped == 0
    for clean, corrupted, (answer,), (distractor,) in zip(task.clean, task.corrupted, task.answers, task.distractors):
        differ = [i for i, (a, b) in enumerate(zip(clean, corrupted)) if a != b]
        assert len(clean) == len(corrupted) and len(differ) == 1  # the one open bracket, of another type
        opened, swapped = clean[differ[0]], corrupted[differ[0]]
        assert opened in BRACKETS and swapped in BRACKETS
        assert chr(answer) == BRACKETS[opened] and chr(distractor) == BRACKETS[swapped]
    names = identifier_task(toy)
    for clean, corrupted, (answer,), (distractor,) in zip(names.clean, names.corrupted, names.answers, names.distractors):
        defined, used = clean.split(" = 0")[0], clean.split("\n    ")[1]
        assert defined.startswith(used) and chr(answer) == defined[len(used)]
        assert chr(distractor) == corrupted.split(" = 0")[0][len(used)] != chr(answer)


def test_the_code_models_bracket_head_is_confirmed_by_ablation_and_the_tools_agree_on_its_circuit():
    """What the guide claims about the shipped "code" model: one layer-1 head (L1H1) attends from the
    last token to the open bracket, its mean ablation erases the bracket-type logit difference, and
    path patching and edge attribution agree on the circuit's strongest edges. No identifier recall."""
    from analyses.interventions.ablation import ablation_sweep
    from analyses.report.task_page import analyse_task

    code = load_model("code")
    task = make_task(code, "brackets")
    batch = task_batch(code, task)
    metric = task_metric(task, batch.last)
    _, cache = code.run_with_cache(batch.clean, names_filter=lambda name: name.endswith("hook_pattern"))
    opened = torch.tensor([next(i for i, (a, b) in enumerate(zip(c, k)) if a != b) + 1
                           for c, k in zip(task.clean, task.corrupted)])  # + 1: the start token
    rows = torch.arange(len(task))
    to_open = torch.stack([cache["pattern", layer][rows, :, batch.last, opened].mean(0) for layer in range(2)])
    assert to_open[1, 1] > 0.4 and to_open[1, 1] > 3 * to_open.flatten()[torch.arange(8) != 5].max()
    ablated = ablation_sweep(code, batch.clean, "each_head", "mean", metric, progress=False)
    assert ablated.loc[ablated["effect"].idxmin(), "target"] == "L1H1"
    assert ablated.set_index("target").loc["L1H1", "metric"] < 0.2 * ablated["baseline"].iloc[0]
    analysis = analyse_task(code, task, top=4, split=False, progress=False)
    assert analysis.values["clean"] > 2 and analysis.values["corrupted"] < -2
    top = analysis.edges.reindex(analysis.edges["effect"].abs().sort_values(ascending=False).index).iloc[0]
    assert (top["sender_layer"], top["sender_head"], top["via"]) == (1, 1, "logits")
    assert analysis.agreement["attribution"]["top_k_overlap"] >= 0.6  # EAP
    assert analysis.agreement["attribution_ig"]["top_k_overlap"] >= 0.6  # EAP-IG
    recall = analyse_task(code, make_task(code, "identifier", n=16), top=1, split=False, progress=False).values
    assert abs(recall["clean"] - recall["corrupted"]) < 0.1


@pytest.mark.parametrize("family", ["llama", "opt"])  # a from-scratch family and a bridge-only one
@pytest.mark.parametrize("name", ["ioi", "greater-than", "induction-text"])
def test_the_built_in_tasks_run_on_random_models_of_other_families(family, name, family_dir):
    from analyses.report.task_page import analyse_task

    model = load_model(family_dir(family))
    task = make_task(model, name, n=2)
    analysis = analyse_task(model, task, top=1, split=False, progress=False)
    batch = task_batch(model, task)
    assert analysis.heads_by_pos["pos"].max() == batch.clean.shape[1] - 1
    assert analysis.values["clean"] == pytest.approx(naive_value(model, task), abs=1e-5)


@pytest.mark.parametrize("name", ["ioi", "greater-than", "induction-text", "brackets", "identifier"])
@pytest.mark.parametrize("tokenizer", ["toy", "bpe_model"])
def test_no_prompt_and_no_cluster_of_a_built_in_task_is_on_both_sides_of_its_split(tokenizer, name, request):
    """A built-in task's clean prompts are distinct, and its split keeps each cluster of near-copies
    (greater-than: one start year under several nouns) on one side, at the default size and at the
    largest the generator can make up to 100; a larger --n is refused in one line."""
    from analyses.tasks.task import task_split

    model = request.getfixturevalue(tokenizer)
    sizes = [None, 100]
    try:
        make_task(model, name, n=100)
    except UserError as error:
        most = int([word for word in str(error).split() if word.isdigit()][0])  # "NAME can make [at most] N ..."
        assert "\n" not in str(error) and str(error).endswith("asked for 100") and most < 100
        sizes[1] = most
    for n in sizes:
        task = make_task(model, name, n=n)
        assert len(set(task.clean)) == len(task)
        if (tokenizer, name) == ("bpe_model", "identifier"):  # the BPE, trained on prose, keeps 1 prompt of a prefix
            with pytest.raises(UserError, match="has 1 prompt"):
                task_split(task)
            continue
        split = task_split(task)
        clusters = task.clusters or task.clean
        sides = [{clusters[i] for i in split.selection.tolist()}, {clusters[i] for i in split.measurement.tolist()}]
        assert not sides[0] & sides[1]
        texts = [{task.clean[i] for i in side.tolist()} for side in (split.selection, split.measurement)]
        assert not texts[0] & texts[1]
    if name == "greater-than":  # one start year under several nouns: a cluster of several prompts, split whole
        assert len(set(task.clusters)) < len(task) and split.record()["n_clusters"] == len(set(task.clusters))
