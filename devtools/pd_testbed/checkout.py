"""Where the files the tests read live in the checkout: the generated CRDs, the example
manifests, the Helm chart, captured engine metrics; and the release the chart tests render.

Everything is found from this file's place (`devtools/pd_testbed/`), so the tests read the
checkout they run from, never an installed copy.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CHART_DIR", "CHART_RELEASE", "CHART_RELEASE_NAMESPACE", "CRDS_DIR", "EXAMPLES",
           "EXAMPLES_DIR", "REPO_ROOT", "UNIT_DATA_DIR"]

REPO_ROOT = Path(__file__).resolve().parents[2]
CRDS_DIR = REPO_ROOT / "crds"
EXAMPLES_DIR = REPO_ROOT / "examples"
EXAMPLES: list[Path] = sorted(EXAMPLES_DIR.glob("*.yaml"))
"""Every example manifest, in name order (tests parametrize over them by file name)."""
CHART_DIR = REPO_ROOT / "charts" / "pd-operator"
CHART_RELEASE = "pdo"
CHART_RELEASE_NAMESPACE = "pd-system"
UNIT_DATA_DIR = REPO_ROOT / "tests" / "unit" / "data"
"""Captured `/metrics` texts and UCX logs the unit tests read (each file says how it was made)."""
