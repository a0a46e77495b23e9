"""The test bed: what the tests and the benchmarks share to drive real components without a
cluster or a GPU (docs/testbed.md). Tests and benchmarks import it; the shipped packages
(`pd_operator`, `pd_transfer`, `pd_contract`) never do (an import-linter contract).

Nothing is imported here: the modules pull in pytest, torch, kopf or the Kubernetes client
as their job needs, and a test imports only the modules it uses. `__all__` names them.

Reading order, by what is driven:
- inputs: `checkout` (files of the checkout), `factories` (PDDeployments), `kube_factories`
  (pods, TransferAgents), `spec_cases` and `crd_schema` (the CRD rules' cases and schema
  defaults), `cel_functions` (Kubernetes' CEL functions for cel-python);
- waiting: `polling`;
- the transfer protocol: `transfer_harness` (loopback, stepped by hand), `nixl_waves` (real
  NIXL between rank processes);
- agents: `agent_fakes` (a fake TransferAgent API), `native_harness` (the engine-native agent
  over captured metrics);
- the router: `router_engines` (stand-in engines over HTTP);
- the control plane: `cluster` (test-side reads and writes), `operator_runner` (the operator
  in-process), `operator_process` (operator processes, leader-elected replicas),
  `rollout_harness` (a live fleet under load for staging rollouts);
- engines: `vllm` (real vLLM servers on CPU), `exposition_text` (cutting metric captures),
  `captures` (the scripts that capture engines' metrics, run by hand);
- GPUs: `gpu` (the pytest plugin that skips `gpu`-marked tests without enough CUDA devices).
"""

__all__ = [
    "agent_fakes",
    "captures",
    "cel_functions",
    "checkout",
    "cluster",
    "crd_schema",
    "exposition_text",
    "factories",
    "gpu",
    "kube_factories",
    "native_harness",
    "nixl_waves",
    "operator_process",
    "operator_runner",
    "polling",
    "rollout_harness",
    "router_engines",
    "spec_cases",
    "transfer_harness",
    "vllm",
]
