"""Benchmarks of the transfer module (``pd-transfer bench ...``): not part of the product.

No product module imports this package (import-linter: "Product modules import neither the
benchmarks nor the reference engine"); only ``pd_transfer.cli``, the command table, does,
through ``cli.add_bench_parser``. Tests and ``benchmarks/`` import its public modules (those
in ``__all__``) directly; this file imports none of them, so that ``python -m
pd_transfer.bench.cli`` runs the module once and importing one module loads no other.

Modules:
- ``cli``: the ``bench`` subcommands (``add_bench_parser``); ``python -m pd_transfer.bench.cli``.
- ``transfer``, ``_ranks``, ``phases``: ``bench transfer``, a request's KV transfer end to end
  per TP combination (one process per rank), its latency split into phases from the stamps.
- ``pipeline``, ``peers``, ``timeline``: ``bench pipeline``, what layer pipelining buys over
  real NIXL, the prefill and decode endpoints it runs, and its PNG timeline.
"""

__all__ = ["cli", "peers", "phases", "pipeline", "timeline", "transfer"]
