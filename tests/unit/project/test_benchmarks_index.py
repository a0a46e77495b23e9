"""`benchmarks/README.md` is the index of the benchmarks: every script in `benchmarks/` has
its entry, every results file it cites is in `benchmarks/results/`, and every link into
`benchmarks/HISTORY.md` lands on a heading there. Guards against an index whose figures
point at files nobody committed, or at history sections that were renamed."""

from __future__ import annotations

import re

import pytest

from pd_testbed.checkout import REPO_ROOT

pytestmark = pytest.mark.timeout(10)

BENCHMARKS = REPO_ROOT / "benchmarks"
INDEX = BENCHMARKS / "README.md"
HISTORY = BENCHMARKS / "HISTORY.md"
CITED = re.compile(r"`([A-Za-z0-9_.{},\-]+\.(?:json|txt|png))`")
LINK = re.compile(r"\]\((HISTORY\.md)?#([^)\s]+)\)")


def _expand(name: str) -> list[str]:
    """`a_{1,2}.json` → `a_1.json`, `a_2.json` (the index's shorthand for rounds)."""
    brace = re.search(r"\{([^{}]*)\}", name)
    if brace is None:
        return [name]
    return [expanded for choice in brace.group(1).split(",")
            for expanded in _expand(name[:brace.start()] + choice + name[brace.end():])]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_results_file_the_index_cites_exists() -> None:
    cited = [name for match in CITED.findall(INDEX.read_text(encoding="utf-8"))
             for name in _expand(match)]
    assert len(cited) >= 30, "the index's results files were not found at all"
    missing = sorted({name for name in cited if not (BENCHMARKS / "results" / name).is_file()})
    assert missing == []


def test_every_benchmark_script_has_an_entry() -> None:
    index = INDEX.read_text(encoding="utf-8")
    scripts = [path.name for path in sorted(BENCHMARKS.iterdir())
               if path.name not in {"README.md", "HISTORY.md", "results", "__pycache__"}]
    assert len(scripts) >= 25
    assert [name for name in scripts if name not in index] == []


def test_links_into_the_history_land_on_its_headings() -> None:
    history = HISTORY.read_text(encoding="utf-8")
    anchors = {_anchor(line.lstrip("#")) for line in history.splitlines()
               if line.startswith("#")}
    links = [(INDEX.name, anchor) for file, anchor in LINK.findall(
        INDEX.read_text(encoding="utf-8")) if file]
    links += [(HISTORY.name, anchor) for file, anchor in LINK.findall(history) if not file]
    assert len(links) >= 30, "the links were not found at all"
    assert [link for link in links if link[1] not in anchors] == []
