"""Deployment assets for Ferry (containers, Kubernetes, Grafana) and the backlog autoscaler."""
