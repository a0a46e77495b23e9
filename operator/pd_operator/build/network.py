"""Headless Services per role: stable DNS names for every engine pod, ready or not.

Not-ready pods are published because peers must handshake (exchange NIXL metadata) before
the transfer readiness gate can turn True.
"""

from __future__ import annotations

from pd_contract.transferagent import Role
from pd_operator.api.resources import PDDeployment
from pd_operator.build.config import bootstrap_port
from pd_operator.build.meta import Manifest, object_meta
from pd_operator.build.names import LABEL_ROLE, role_selector, role_workload


def build_headless_service(pdd: PDDeployment, role: Role) -> Manifest:
    name = pdd.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(pdd, role_workload(name, role), role.value,
                                {LABEL_ROLE: role.value}),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": role_selector(name, role),
            "ports": [
                {"name": "http", "port": pdd.spec.engine.port, "targetPort": "http",
                 "protocol": "TCP"},
                {"name": "kv-bootstrap", "port": bootstrap_port(pdd),
                 "targetPort": "kv-bootstrap", "protocol": "TCP"},
            ],
        },
    }
