"""Where the repository is, for tests that run its files (scripts, docs, deploy configs)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
