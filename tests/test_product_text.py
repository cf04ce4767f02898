"""The product speaks of itself only: no issue reference in what a user reads or runs.

An issue number means nothing to a user. The README, the changelog, the docs, the notebooks, the benchmarks and
their results, and the package's and tests' docstrings and comments say what a figure measures or why code is
as it is, never which ticket asked for it.
"""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# in prose, "#34" is an issue reference unless it is part of a word, a path, an anchor or a colour
PROSE_REF = re.compile(r"(?<![&\w/#=-])#[1-9]\d{0,3}\b(?![\w-])")
# in code and data "#12" also names a run of the ledger ("run #3", "#12 train"): only an issue's forms count
CODE_REF = re.compile(
    r",\s#[1-9]\d{0,3}\)"  # a number after a comma, closing a parenthesis
    r"|\(#[1-9]\d{0,3}\)[.:,;]"  # a number alone in parentheses, closing a clause
    r"|#[1-9]\d{0,3}'s\b"  # a number's possessive
    r"|\bissues?\s+#?[1-9]\d{0,3}\b",  # the word issue and a number
    re.I,
)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def _prose(markdown: str) -> str:
    return CODE_SPAN.sub("", FENCE.sub("", markdown))


def _markdown_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md"),
             *(ROOT / "benchmarks").rglob("*.md")]
    return [path for path in files if path.is_file()]


def _code_files() -> list[Path]:
    folders = ("flair_nbddp", "benchmarks", "tests", "docs", "binder", ".ci")
    files = [path for folder in folders for path in (ROOT / folder).rglob("*") if path.is_file()]
    files += [ROOT / name for name in ("Makefile", "pyproject.toml", "mkdocs.yml")]
    return [path for path in files if path.suffix not in {".md", ".ipynb", ".png", ".pyc", ".svg"}]


def _hits(text: str, pattern: re.Pattern, where: str) -> list[str]:
    return [f"{where}:{number}: {line.strip()[:120]}" for number, line in enumerate(text.splitlines(), 1)
            if pattern.search(line)]  # fmt: skip


def test_no_issue_references_in_markdown():
    hits = [hit for path in _markdown_files() for hit in _hits(_prose(path.read_text()), PROSE_REF, str(path))]
    assert hits == [], "issue references (say what it measures or does instead):\n" + "\n".join(hits[:10])


def test_no_issue_references_in_notebooks():
    hits = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for index, cell in enumerate(json.loads(path.read_text())["cells"]):
            where, source = f"{path.name}, cell {index}", "".join(cell["source"])
            if cell["cell_type"] == "markdown":
                hits += _hits(_prose(source), PROSE_REF, where)
            else:
                outputs = json.dumps(cell.get("outputs", []))
                hits += _hits(source, CODE_REF, where) + _hits(outputs, CODE_REF, f"{where} output")
    assert hits == [], "issue references in the notebooks:\n" + "\n".join(hits[:10])


def test_no_issue_references_in_code_data_or_results():
    hits = []
    for path in _code_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        hits += _hits(text, CODE_REF, str(path.relative_to(ROOT)))
    assert hits == [], "issue references in code, comments or results:\n" + "\n".join(hits[:10])


def test_the_patterns_find_issue_references_and_nothing_else():
    n = "34"  # the examples are made here, so that this file names no issue itself
    assert PROSE_REF.search(f"the fix (#{n}) holds") and PROSE_REF.search(f"#{n}'s goal")
    assert not PROSE_REF.search("colour #3b82f6 or [link](page.md#12-options) or C#")
    for text in (f"H200, #{n})", f"the fix (#{n}).", f"#{n}'s set-up", f"see issue {n}"):
        assert CODE_REF.search(text), text
    for text in ("run #3 'train'", "RunRecord(#12 train: finished", "run 2 (#57) · 35 s", "trial #3 pruned"):
        assert not CODE_REF.search(text), text
