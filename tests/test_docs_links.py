"""Every file the docs link to, and every repository path the docs or the code cite, exists.

A reader follows these references: a link in README.md, docs/ (its dated notes too) or
a README under benchmarks/ that 404s, or a comment
that sends them to a file that was renamed, is a broken promise. Links are checked down
to their `#anchor` (GitHub's heading slugs); paths are found in backticks in the docs
and anywhere in the comments and docstrings of the code.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "benchmarks").rglob("*.md")]
)
CODE = sorted(
    p
    for folder in ("kvchat", "tests", "benchmarks", ".ci")
    for p in (ROOT / folder).rglob("*")
    if p.suffix in (".py", ".cpp", ".h", "") and p.is_file() and "__pycache__" not in p.parts
)
TOP = ("kvchat", "tests", "benchmarks", "docs", "themes", ".ci")
# a repository path: a top-level folder, then path characters; no placeholders (<date>, *)
REPO_PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(map(re.escape, TOP)) + r")/[\w./-]*)")
# kvchat's own modules cited from inside the package, e.g. `engine/step_pacer.py`
PACKAGE_PATH = re.compile(
    r"(?<![\w./-])((?:model|engine|chat|tui|native|bench)/[\w/]+\.(?:py|cpp|h))"
)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# folders a command creates when it runs, never committed
GENERATED = ("benchmarks/runs/",)


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading (underscores stay: `step_token_budget`)."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return {_slug(line.lstrip("#")) for line in lines if re.match(r"#{1,6} ", line)}


def _exists(cited: str) -> bool:
    cited = cited.rstrip(".,:;")
    if cited.startswith(GENERATED):
        return True
    return (ROOT / cited).exists()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_in_the_docs_reaches_a_file_and_heading(doc: Path):
    broken = []
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        missing_anchor = anchor and path.suffix == ".md" and anchor not in _anchors(path)
        if not path.exists() or missing_anchor:
            broken.append(target)
    assert not broken, f"{doc.name} links to what does not exist: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_path_the_docs_cite_exists(doc: Path):
    text = doc.read_text(encoding="utf-8")
    cited = {m for span in re.findall(r"`([^`]+)`", text) for m in REPO_PATH.findall(span)}
    missing = sorted(c for c in cited if not _exists(c))
    assert not missing, f"{doc.name} cites paths that do not exist: {missing}"


def test_every_path_the_code_cites_exists():
    missing = []
    for source in CODE:
        text = source.read_text(encoding="utf-8", errors="replace")
        for cited in REPO_PATH.findall(text):
            if not _exists(cited):
                missing.append(f"{source.relative_to(ROOT)}: {cited}")
        for cited in PACKAGE_PATH.findall(text):
            if not (ROOT / "kvchat" / cited).exists() and not _exists(cited):
                missing.append(f"{source.relative_to(ROOT)}: {cited}")
    assert not missing, "paths cited in the code that do not exist:\n" + "\n".join(missing)


def test_the_docs_do_not_speak_of_how_the_project_was_developed():
    pattern = re.compile(
        r"(third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth) session"
        # (written so that this file does not match itself)
        r"|earlier session[s]|the session's (start|final code)|issue [0-9]+|issues['] bars"
        r"|(?-i:DESIGN\.md|NOTES\.md)",
        re.IGNORECASE,
    )
    found = []
    for path in [*DOCS, *CODE]:
        if path == Path(__file__).resolve():
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines()):
            if pattern.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n + 1}: {line.strip()}")
    assert not found, "\n".join(found)
