"""Evaluation suite: metrics, runners, benchmarks and reports (no heavy imports here)."""
