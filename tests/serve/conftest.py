"""tests/serve: real ``vllm serve`` runs (heavy; selected with ``-m serve``, nox -s serve_cpu)."""

from __future__ import annotations


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "serve: starts real `vllm serve` processes (minutes; nox -s serve_cpu)")
