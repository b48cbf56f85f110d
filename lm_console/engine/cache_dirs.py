"""Where lm-console keeps files between runs: one root, found the same way by every part.

The root is `$LMC_CACHE_DIR`, else `$XDG_CACHE_HOME/lm-console`, else `~/.cache/lm-console`.
Under it: `models/` (the embedded model converted from its GGUF, packed quantized weights),
`kernels/` (the C kernels compiled for this machine) and `logs/` (the console's engine logs,
`$LMC_LOG_DIR` overriding). Torch-free, so the console and the kernels' loader use it alike.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The root of lm-console's on-disk cache (not created here)."""
    if os.environ.get("LMC_CACHE_DIR"):
        return Path(os.environ["LMC_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "lm-console"


def log_dir() -> Path:
    """Where the console writes its engine logs: `$LMC_LOG_DIR`, else `logs/` under the cache root."""
    if os.environ.get("LMC_LOG_DIR"):
        return Path(os.environ["LMC_LOG_DIR"]).expanduser()
    return cache_root() / "logs"
