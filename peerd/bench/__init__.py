"""Heterogeneity benchmarks in the lab: peerd's algorithms against an All-Reduce (DDP) baseline."""
