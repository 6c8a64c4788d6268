"""Kubernetes operator reconciling DiffusionDeployment objects into engine pods."""
