"""pd-operator: reconciles PDDeployments into prefill/decode serving workloads."""

__version__ = "0.1.0"
