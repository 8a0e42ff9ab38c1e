"""Every example in README.md and docs/guides/*.md runs as written, so an example cannot drift from the code.

- Python: each page's ```python blocks run in order in one namespace (a block may use what an earlier
  block of the same page defined; a page is self-contained), in a temporary working directory.
- Commands: every ``interp ...`` line of a ```bash (or unlabelled) block, lines continued with ``\\`` joined, is parsed by
  the real argument parser, so a wrong flag or command name fails; every command not marked is run
  in-process (``analyses.cli.main``) in a temporary working directory and must exit 0 (run by
  tests/test_doc_commands.py and, the report guide's, tests/test_doc_commands_report.py).
- The working directory holds what the examples name: the repository's ``examples/`` and, for the
  placeholders (``path/to/gpt2``, ``path/to/model-dir``, ``DIR``, ``path/to/llama-dir``, ... : ``PLACEHOLDERS``),
  tiny random-init models of that family.

The convention for an example that cannot run here (a GPU, a hub id, a placeholder, minutes of CPU):
``<!-- not run: REASON -->`` on the line right before a fence marks the whole block; a command line whose
comment contains ``not run: REASON`` marks that command. A marked command is still parsed. The reason
must be given. Outputs the pages quote are checked in the tests at the end.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "guides").glob("*.md"))]

_FENCE = re.compile(r"^(?P<mark><!-- not run: (?P<reason>[^>]*?) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)^```$",
                    re.M | re.S)
_COMMAND = re.compile(r"^\s*(\w+=\S*\s+)*interp\s")  # interp ..., after VAR=value settings
_NOT_RUN = re.compile(r"#.*\bnot run: (?P<reason>.+)$")
# placeholders in the pages' commands and code -> a tiny random-init family the test writes there
SHELL = ("bash", "")  # the fences whose interp lines are commands
PLACEHOLDERS = {name: "gpt2" for name in ("path/to/gpt2", "path/to/model-dir", "path/to/model", "DIR", "path/to/base",
                                          "path/to/finetune")} | {"path/to/llama-dir": "llama", "path/to/llama": "llama"}
# the stand-ins' shapes beyond their family's tiny default: room for the pages' heads (1.4) and MLPs (mlp3@7)
STAND_IN = {"gpt2": dict(n_layer=4, n_head=8), "llama": {}}


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: its language, its text, the line its fence opens on, and why it is
    not run (None: it runs)."""

    page: str
    line: int
    lang: str
    body: str
    not_run: str | None


@dataclass(frozen=True)
class Command:
    """One ``interp`` command of a bash block: its arguments after ``interp`` and why it is not run."""

    where: str
    argv: list[str]
    not_run: str | None


def blocks(text: str, page: str = "<text>") -> list[Block]:
    """The fenced blocks of a markdown text, in order."""
    found = []
    for match in _FENCE.finditer(text):
        reason = match["reason"]
        if match["mark"] is not None and not reason.strip():
            raise AssertionError(f"{page}: 'not run:' without a reason")
        line = text.count("\n", 0, match.start("lang")) + 1
        found.append(Block(page, line, match["lang"], match["body"], reason))
    return found


def commands(block: Block) -> list[Command]:
    """The ``interp`` commands of a bash block; a command's own ``not run:`` comment or the block's marks it."""
    found = []
    for offset, line in _logical_lines(block.body):
        if not _COMMAND.match(line):
            continue
        words = shlex.split(line, comments=True)
        environment = words.index("interp")  # VAR=value settings before it
        own = _NOT_RUN.search(line)
        reason = own["reason"].strip() if own else block.not_run
        found.append(Command(f"{block.page}:{block.line + 1 + offset}", words[environment + 1:], reason))
    return found


def _logical_lines(body: str):
    """(offset of the first physical line, line) with ``\\``-continued lines joined."""
    pending, start = "", 0
    for offset, physical in enumerate(body.splitlines()):
        if not pending:
            start = offset
        if physical.rstrip().endswith("\\"):
            pending += physical.rstrip()[:-1] + " "
            continue
        yield start, pending + physical
        pending = ""
    if pending:
        yield start, pending


def run_python(page_blocks: list[Block]) -> tuple[dict, str]:
    """Exec a page's runnable python blocks in order in one namespace (cwd: the caller's) -> (the
    namespace, what they printed)."""
    namespace: dict = {"__name__": "__doc_example__"}
    printed = io.StringIO()
    for block in page_blocks:
        if block.lang != "python" or block.not_run is not None:
            continue
        code = compile(block.body, f"{block.page}:{block.line}", "exec")
        with warnings.catch_warnings(), contextlib.redirect_stdout(printed):
            exec(code, namespace)
    return namespace, printed.getvalue()


def parse_command(command: Command):
    """The real parser's namespace for a command; a wrong flag or command fails with the line named."""
    from analyses.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(command.argv)
    except SystemExit:
        raise AssertionError(f"{command.where}: interp {shlex.join(command.argv)}\n{err.getvalue()}") from None


def run_command(command: Command) -> None:
    """Run a command in-process in the caller's working directory; it must exit 0."""
    from analyses.cli import main

    err = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(command.argv)
        except SystemExit as exit:
            code = exit.code
    assert code == 0, f"{command.where}: interp {shlex.join(command.argv)} exited {code}\n{err.getvalue()[-3000:]}"


def page_blocks(page: str) -> list[Block]:
    return blocks((ROOT / page).read_text(encoding="utf-8"), page)


def all_commands() -> list[Command]:
    return [command for page in PAGES for block in page_blocks(page) if block.lang in SHELL
            for command in commands(block)]


def quoted_output(block: Block, after: str) -> list[str]:
    """The output a page quotes under the line of ``block`` holding ``after``: the comment lines that
    follow it, without their ``# ``."""
    lines = block.body.splitlines()
    start = next(i for i, line in enumerate(lines) if after in line) + 1
    quoted = []
    for line in lines[start:]:
        if not line.startswith("# "):
            break
        quoted.append(line[2:])
    assert quoted, f"{block.page}:{block.line}: no output quoted under {after!r}"
    return quoted


@pytest.fixture(scope="module")
def placeholder_models(tmp_path_factory):
    """family -> a tiny random-init model directory that the placeholders stand for."""
    from interp.random_models import save_random_model

    return {family: save_random_model(family, tmp_path_factory.mktemp(family), seed=3, **shape)
            for family, shape in STAND_IN.items()}


@pytest.fixture
def workdir(tmp_path, monkeypatch, placeholder_models):
    """A fresh working directory holding the repository's examples/ and the placeholder models."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for placeholder, family in PLACEHOLDERS.items():
        (tmp_path / placeholder).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / placeholder).symlink_to(placeholder_models[family])
    monkeypatch.chdir(tmp_path)
    return tmp_path


PYTHON_PAGES = [page for page in PAGES if any(b.lang == "python" for b in page_blocks(page))]
COMMAND_PAGES = [page for page in PAGES if any(c.not_run is None for b in page_blocks(page) if b.lang in SHELL
                                                for c in commands(b))]


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_python_examples_run(page, workdir):
    """A page's python blocks run in order; the outputs it quotes are what they give."""
    blocks_ = page_blocks(page)
    namespace, printed = run_python(blocks_)
    if page in OUTPUT_CHECKS:
        OUTPUT_CHECKS[page](blocks_, namespace, printed)


def test_every_command_parses():
    found = all_commands()
    assert len(found) > 50
    for command in found:
        parse_command(command)


def run_page_commands(page: str, workdir: Path) -> None:
    """A page's unmarked commands run in order in one working directory; what it quotes of their
    outputs is what they wrote. (The tests that call it, in tests/test_doc_commands.py and
    tests/test_doc_commands_report.py, are modules of their own so that pytest-xdist, which gives each
    module to one worker, runs them beside this one's.)"""
    for block in page_blocks(page):
        if block.lang in SHELL:
            for command in commands(block):
                if command.not_run is None:
                    run_command(command)
    if page in COMMAND_CHECKS:
        COMMAND_CHECKS[page](workdir)


def trailing_comment(block: Block, after: str) -> str:
    """The comment a page writes beside the line of ``block`` holding ``after``, continued on the
    comment-only lines below it, joined with single spaces."""
    lines = block.body.splitlines()
    start = next(i for i, line in enumerate(lines) if after in line)
    parts = [lines[start].split("# ", 1)[1]]
    for line in lines[start + 1:]:
        if not line.lstrip().startswith("#"):
            break
        parts.append(line.lstrip()[1:])
    return " ".join(part.strip() for part in parts)



# The outputs the pages quote, checked against what their examples gave: page -> check(blocks,
# namespace, printed).

def readme_prints_the_effect_it_quotes(page: list[Block], namespace: dict, printed: str) -> None:
    """The quick start's snippet prints the induction heads' ablation effect with its interval and
    baseline, as the README quotes it, and the roles its comment names."""
    quoted = quoted_output(next(b for b in page if b.lang == "python"), "print(ablated")
    assert [line.split() for line in quoted] == [line.split() for line in printed.splitlines()[-2:]]
    assert attention_roles(namespace["roles"]) == TOY_ATTENTION_ROLES


# the embedded model's attention roles at the report's rule: L0H3 previous-token, every layer-1 head induction
TOY_ATTENTION_ROLES = {(0, 3, "previous_token")} | {(1, head, "induction") for head in range(8)}


def attention_roles(roles) -> set[tuple[int, int, str]]:
    """(layer, head, role) of a head table's previous-token and induction roles."""
    return {(layer, head, role) for layer, head, held in zip(roles["layer"], roles["head"], roles["role"])
            for role in held.split(";") if role in ("previous_token", "induction")}


def components_builds_the_reports_roles_by_hand(page: list[Block], namespace: dict, printed: str) -> None:
    """components.md's roles "by hand" are the report's rule's, as its comment says: the toy's
    previous-token head and its eight induction heads, not every layer-0 head (significance alone)."""
    assert attention_roles(namespace["by_hand"]) == TOY_ATTENTION_ROLES


def interventions_quotes_what_describe_says(page: list[Block], namespace: dict, printed: str) -> None:
    """The control's one-line summary quoted in interventions.md is what ``describe()`` returns."""
    quoted = trailing_comment(next(b for b in page if "found.describe()" in b.body), "found.describe()")
    assert quoted == repr(namespace["found"].describe())


def report_guide_quotes_the_summary_its_commands_write(workdir: Path) -> None:
    """The summary report.md quotes is, line by line in order, the summary of the report its commands
    wrote to r/s (``...`` stands for what the quote leaves out; blank lines aside; the closing line naming the
    page is tests/test_report_summary.py's)."""
    quoted = next(b for b in page_blocks("docs/guides/report.md") if b.body.startswith("Found\n")).body
    markdown = (workdir / "r" / "s" / "report.md").read_text(encoding="utf-8")
    summary = markdown.split("## Summary\n", 1)[1].split("\n## ", 1)[0].replace("**", "").splitlines()
    lines = iter(summary)
    for line in quoted.splitlines():
        if not line or line.startswith("The report: "):
            continue
        pattern = re.compile(".*?".join(re.escape(part) for part in line.split("...")))
        assert any(pattern.fullmatch(written) for written in lines), (line, summary)


def tasks_traces_the_answers_first_letter(page: list[Block], namespace: dict, printed: str) -> None:
    """tasks.md's causal trace runs on the page's byte-level model and reads what the page says it
    reads there: " Paris"'s first letter, "P", its leading space moved onto the end of the prompt."""
    from analyses.core.tokens import model_tokenizer

    trace = namespace["trace"]
    assert model_tokenizer(namespace["model"]).decode([trace.answer]) == "P"
    last = trace.frame[trace.frame["pos"] == trace.frame["pos"].max()]
    assert set(last["token"]) == {" "}


COMMAND_CHECKS = {"docs/guides/report.md": report_guide_quotes_the_summary_its_commands_write}  # page -> check(workdir)
OUTPUT_CHECKS = {"README.md": readme_prints_the_effect_it_quotes,
                 "docs/guides/components.md": components_builds_the_reports_roles_by_hand,
                 "docs/guides/tasks.md": tasks_traces_the_answers_first_letter,
                 "docs/guides/interventions.md": interventions_quotes_what_describe_says}


def test_the_runner_catches_a_wrong_example(workdir):
    """The machinery above fails on a page whose example is wrong: an unknown flag, an unknown command,
    a name no block defined, a command that exits non-zero; it honours both marks and their reasons."""
    page = "\n".join([
        "```bash", "interp ablate --no-such-flag --out runs/a", "interp no-such-command",
        "interp check --model no/such/dir",
        "interp report --model toy --out r   # a comment; not run: too slow", "```",
        "<!-- not run: a GPU -->", "```bash", "interp check --model toy --device cuda", "```",
        "```python", "x = 1", "```", "```python", "print(x + undefined_name)", "```"])
    found = blocks(page)
    assert [b.lang for b in found] == ["bash", "bash", "python", "python"]
    wrong_flag, wrong_command, missing_model, marked = commands(found[0])
    for command in (wrong_flag, wrong_command):
        with pytest.raises(AssertionError, match="<text>:"):
            parse_command(command)
    parse_command(missing_model)
    with pytest.raises(AssertionError, match="exited 2"):
        run_command(missing_model)
    assert marked.not_run == "too slow" and missing_model.not_run is None
    assert [c.not_run for c in commands(found[1])] == ["a GPU"]
    with pytest.raises(NameError, match="undefined_name"):
        run_python(found)
    with pytest.raises(AssertionError, match="without a reason"):
        blocks("<!-- not run:  -->\n```python\nx = 1\n```\n")


def test_the_tasks_guide_quotes_what_interp_task_says_of_the_toy():
    """tasks.md quotes ``interp task ioi --model toy``'s WARNING line and the induction-text gap: the
    verdict ``interp task`` prints, computed as it does (the default prompts and seed, measured on the
    measurement split)."""
    from analyses.core.stats import effect_text
    from analyses.tasks.task import make_task, task_batch, task_measure_intervals, task_performance, task_split
    from interp import load_model

    page = (ROOT / "docs" / "guides" / "tasks.md").read_text(encoding="utf-8")
    model = load_model("toy")
    verdicts = {}
    for name in ("ioi", "induction-text"):
        task = make_task(model, name, None, 0)
        measured = task.subset(task_split(task, 0).measurement.tolist())
        verdicts[name] = task_performance(task_measure_intervals(model, measured, task_batch(model, measured)),
                                          measured.metric)
    quoted = next(b for b in page_blocks("docs/guides/tasks.md") if b.body.startswith("WARNING:")).body.strip()
    assert quoted == f"WARNING: {verdicts['ioi'].text}"
    gap = verdicts["induction-text"]
    quoted = f"`clean - corrupted logit_diff {effect_text(*gap.gap)}` over {gap.n_prompts} prompts"
    assert quoted in " ".join(page.split())
