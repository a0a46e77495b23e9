"""Every design note the code and tests cite lives in the repository, and every numbered
failure mode they cite exists. Guards against comments that point at documents a reader of
the repository cannot open. Needs neither NIXL nor a GPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pd_testbed.checkout import REPO_ROOT

pytestmark = pytest.mark.timeout(10)

ROOT = REPO_ROOT
SOURCES = ("operator", "transfer", "contract", "devtools", "tests", "benchmarks", "charts", "docs")
DOC_REFERENCE = re.compile(r"docs/([a-z0-9-]+\.md)((?: ?#\d+,?)*)")
ENTRY = re.compile(r"^\| (\d+) \|", re.MULTILINE)


def _cited() -> list[tuple[Path, str, list[int]]]:
    found = []
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix not in {".py", ".md", ".yaml", ".tpl"} or ".venv" in path.parts:
                continue
            for match in DOC_REFERENCE.finditer(path.read_text(encoding="utf-8")):
                numbers = [int(n) for n in re.findall(r"\d+", match.group(2))]
                found.append((path.relative_to(ROOT), match.group(1), numbers))
    return found


def test_cited_design_notes_exist_and_cited_failure_modes_are_entries() -> None:
    citations = _cited()
    assert len(citations) >= 50, "the failure-mode references were not found at all"
    entries = {int(n) for n in ENTRY.findall((ROOT / "docs/failure-modes.md").read_text())}
    assert entries == set(range(1, 53))
    dangling = [
        f"{path}: docs/{doc}" for path, doc, _ in citations if not (ROOT / "docs" / doc).is_file()
    ]
    unknown = [
        f"{path}: docs/{doc} #{n}"
        for path, doc, numbers in citations
        for n in numbers
        if doc == "failure-modes.md" and n not in entries
    ]
    assert dangling == [] and unknown == []


def test_no_reference_to_design_files_outside_the_repository() -> None:
    """The design notes were once cited by bare names (the failure list by number, the
    style and test-bed notes by file name) that resolve nowhere in the repository."""
    bare = re.compile(r"\b(FAILURES(\.md)? ?#?\d|STYLE\.md|TESTBED\.md|ARCHITECTURE\.md)")
    offenders = [
        str(path.relative_to(ROOT))
        for top in SOURCES
        for path in sorted((ROOT / top).rglob("*.py"))
        if path != Path(__file__).resolve() and bare.search(path.read_text(encoding="utf-8"))
    ]
    assert offenders == []
