"""Where the repository's bundled data lives (benchmarks, role trajectories, trained adapters)."""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
"""``data/`` of the repository: ``benchmarks/``, ``trajectories/`` and ``adapters/`` (see data/README.md)."""
