"""The Kubernetes platform: a kopf operator for the ``AegisJob`` custom resource."""
