"""The package version, in one place: pyproject.toml reads it (`dynamic = ["version"]`), `lmc
--version` prints it and the server's GET /version returns it. Torch-free, imports nothing."""

from __future__ import annotations

__version__ = "0.1.0"
