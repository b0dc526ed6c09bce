"""Docs for their readers (issue 15, tried as a new user would): README.md was 412 lines, more than half the
dock's semantics and dated figures, and tests cited docs/dock.md, which did not exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITE = re.compile(r"\bdocs/([\w.-]+\.md)")


def test_every_cited_document_exists():
    sources = [*ROOT.glob("python_tests/*.py"), *ROOT.glob("src/msrl_core/**/*.py"), *ROOT.glob("bench/*.py")]
    sources += [ROOT / "README.md", *ROOT.glob("docs/*.md")]
    cited = {(p.relative_to(ROOT), m) for p in sources for m in CITE.findall(p.read_text(encoding="utf-8"))}
    assert ("python_tests/test_dock_example.py", "dock.md") in {(str(p), m) for p, m in cited}
    missing = sorted((str(p), m) for p, m in cited if not (ROOT / "docs" / m).is_file())
    assert not missing, missing


def test_readme_is_a_newcomers_page():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    for heading in ("## Two commands", "## Train your model", "## Use the library from your trainer",
                    "## What has and has not run"):  # fmt: skip
        assert heading in text, heading
    assert "make demo" in text and "msrl train model.path=" in text
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text)  # dated figures live in bench/README.md
