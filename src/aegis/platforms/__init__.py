"""Platforms that create, replace and delete pods: local, slurm, kubernetes."""
