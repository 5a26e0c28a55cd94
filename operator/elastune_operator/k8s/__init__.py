"""The operator on Kubernetes: kopf handlers, the runtime that drives the control core, the workload."""
