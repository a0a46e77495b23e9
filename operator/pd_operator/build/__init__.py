"""Desired state of a PDDeployment's children, as pure functions of the PDDeployment.

`build_children(pdd, capabilities)` returns every child manifest in apply order (identity and
config before the workloads that use them). Each manifest is complete: labels, the
desired-state hash annotation, and a controller owner reference to the PDDeployment, so tests
compare whole objects and the garbage collector removes children with their owner.
No Kubernetes client is imported here.
"""

from pd_operator.build.capabilities import DEFAULT_AGENT_IMAGE, Capabilities
from pd_operator.build.children import build_children, child_key, desired_hash
from pd_operator.build.names import FIELD_MANAGER

__all__ = [
    "DEFAULT_AGENT_IMAGE",
    "FIELD_MANAGER",
    "Capabilities",
    "build_children",
    "child_key",
    "desired_hash",
]
