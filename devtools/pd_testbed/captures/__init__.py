"""Scripts, run by hand, that capture engines' `/metrics` texts into `tests/unit/data/` for
the engine-native agent's unit tests (each capture's header says how it was made):

- `vllm_nixl_metrics`: vLLM NixlConnector servers on CPU (`python -m
  pd_testbed.captures.vllm_nixl_metrics [OUT_DIR]`);
- `sglang_metrics`: SGLang's own metrics collector, without a server (SGLang has no CPU
  build; `python -m pd_testbed.captures.sglang_metrics [OUT_DIR]`, its docstring says with
  which interpreter).

Not tests and not imported by anything: they live in the test bed, as the rest of what the
tests share, because `tests/` holds only test modules and conftests (import-linter).
Nothing is imported here.
"""

__all__ = ["sglang_metrics", "vllm_nixl_metrics"]
