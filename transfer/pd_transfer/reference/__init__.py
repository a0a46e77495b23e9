"""Reference tooling of the transfer module: a stand-in engine and the tools that drive and
check it. Not part of the product.

No product module imports this package (import-linter: "Product modules import neither the
benchmarks nor the reference engine"); only ``pd_transfer.cli``, the command table, does, for
``pd-transfer engine``, ``pd-transfer load`` and ``pd-transfer selftest``. The benchmarks
(``pd_transfer.bench``) and the tests import its public modules (those in ``__all__``)
directly; this file imports none of them, so importing one module loads no other.

Modules:
- ``model``: ``ReferenceModel``, a small Llama-style transformer writing and reading its KV
  through ``KVPool``s (the layer pipeline's runnable example, PIPELINE.md).
- ``kvdata``: seeded request KV; fill prefill pools, check decode pools bit-exactly.
- ``selftest``: ``pd-transfer selftest``, prefill and decode rank processes over real NIXL,
  every transferred byte checked.
- ``engine``: ``pd-transfer engine``, the reference engine of one pod (framework
  ``reference``: ranks, HTTP API, test-only faults, the agent).
- ``load``: ``pd-transfer load``, steady requests prefill → decode through a deployment.
"""

__all__ = ["engine", "kvdata", "load", "model", "selftest"]
