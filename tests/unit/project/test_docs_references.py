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
    assert entries == set(range(1, 61))
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


_CITED_PATH = re.compile(r"`([A-Za-z0-9_./-]+/[A-Za-z0-9_.-]+\.(?:py|md|sh|yaml|toml))`")


def test_every_path_a_document_cites_names_a_file_of_the_checkout() -> None:
    """A module moved or renamed (a wing of pd_transfer, a test folder) left its old path in
    a README's file map or change map. A cited path counts when it names a file from the
    document's folder or ends the path of a file in the checkout (`vllm/rank.py`);
    benchmarks/HISTORY.md keeps the paths of its day."""
    files = [path for top in SOURCES for path in sorted((ROOT / top).rglob("*.md"))
             if ".venv" not in path.parts and path.name != "HISTORY.md"]
    files += sorted(ROOT.glob("*.md"))
    checkout = [str(path.relative_to(ROOT)) for top in (*SOURCES, "examples", "images", "crds")
                for path in (ROOT / top).rglob("*") if path.is_file()]
    checkout += [path.name for path in ROOT.iterdir() if path.is_file()]
    missing = [
        f"{doc.relative_to(ROOT)}: {cited}"
        for doc in files
        for cited in _CITED_PATH.findall(doc.read_text(encoding="utf-8"))
        if not (doc.parent / cited).is_file()
        and not any(path == cited or path.endswith("/" + cited) for path in checkout)
    ]
    assert len(files) >= 10
    assert missing == []


def test_the_transfer_module_map_names_every_module_and_package() -> None:
    """transfer/pd_transfer/README.md's file map names every top-level module and package of
    pd_transfer, and every module of its wings (kv, trust, common, rank), by its path."""
    package = ROOT / "transfer" / "pd_transfer"
    readme = (package / "README.md").read_text(encoding="utf-8")
    entries = [path.name if path.is_file() else path.name + "/"
               for path in sorted(package.iterdir())
               if (path.suffix == ".py" and path.name != "__init__.py")
               or (path.is_dir() and (path / "__init__.py").is_file())]
    wings = [f"{wing}/{path.name}" for wing in ("kv", "trust", "common", "rank")
             for path in sorted((package / wing).glob("*.py")) if path.name != "__init__.py"]
    assert len(entries) >= 15 and len(wings) >= 16
    assert [name for name in entries + wings if f"`{name}`" not in readme] == []
