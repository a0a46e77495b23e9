"""`spec.network` of a PDDeployment: RDMA devices and the NetworkPolicies of its pods."""

from __future__ import annotations

from pydantic import Field

from pd_contract.api import APIModel

__all__ = ["NetworkPolicySpec", "NetworkSpec", "PeerSelector", "RDMASpec"]


class RDMASpec(APIModel):
    """RDMA devices for the transfer, from a device plugin and (optionally) Multus."""

    enabled: bool = Field(
        default=True, description="Request RDMA devices for every engine pod."
    )
    resource_name: str = Field(
        default="rdma/ib",
        min_length=1,
        description="Extended resource the RDMA device plugin advertises "
        "(e.g. rdma/ib, rdma/rdma_shared_device_a, nvidia.com/hostdev).",
    )
    resource_count: int = Field(
        default=1, ge=1, le=64, description="Devices of that resource per pod."
    )
    ib_devices: list[str] = Field(
        default_factory=list,
        description="IB devices and ports for UCX_NET_DEVICES, e.g. [mlx5_0:1, mlx5_1:1]; "
        "UCX picks when empty.",
    )
    networks: list[str] = Field(
        default_factory=list,
        description="Multus NetworkAttachmentDefinitions to attach, as namespace/name or "
        "name.",
    )
    required: bool = Field(
        default=True,
        description="Treat a transfer that falls back to TCP as a failure "
        "(TransportVerified=False).",
    )


class PeerSelector(APIModel):
    """Pods allowed in by a NetworkPolicy rule: those matching both selectors."""

    namespace_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Labels of their namespace (matchLabels); empty matches every namespace.",
    )
    pod_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Labels of the pods (matchLabels); empty matches every pod.",
    )


class NetworkPolicySpec(APIModel):
    """NetworkPolicies that admit ingress to the engine pods only from this PDDeployment's
    own pods, its router, the metrics scraper and the listed HTTP clients."""

    enabled: bool = Field(
        default=True, description="Create a NetworkPolicy per role and one for the router."
    )
    # A plain default (not a factory) so that the generated CRD carries it too and the API
    # server stores what the operator parses.
    metrics_scraper: PeerSelector = Field(
        default=PeerSelector(
            namespace_labels={"kubernetes.io/metadata.name": "monitoring"},
            pod_labels={"app.kubernetes.io/name": "prometheus"},
        ),
        description="Who may scrape the engines' HTTP (/metrics) and transfer metrics ports; "
        "the default is Prometheus in the monitoring namespace.",
    )
    http_clients: list[PeerSelector] = Field(
        default_factory=list,
        description="Other clients of the engines' HTTP port (an external router or gateway, "
        "needed when router.enabled is false).",
    )


class NetworkSpec(APIModel):
    """Networking of the engine pods."""

    rdma: RDMASpec = Field(default_factory=RDMASpec, description="RDMA settings.")
    policy: NetworkPolicySpec = Field(
        default_factory=NetworkPolicySpec, description="Ingress NetworkPolicies."
    )
