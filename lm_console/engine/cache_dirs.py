"""Where lm-console keeps files between runs: one root, found the same way by every part.

The root is `$LMC_CACHE_DIR`, else `$XDG_CACHE_HOME/lm-console`, else `~/.cache/lm-console`.
Under it: `models/` (the embedded model converted from its GGUF, packed quantized weights),
`kernels/` (the C kernels compiled for this machine) and `logs/` (the console's engine logs,
`$LMC_LOG_DIR` overriding). Torch-free, so the console and the kernels' loader use it alike.
"""

from __future__ import annotations

from pathlib import Path

from lm_console.engine import envs


def cache_root() -> Path:
    """The root of lm-console's on-disk cache (not created here)."""
    if envs.LMC_CACHE_DIR.is_set():
        return Path(envs.LMC_CACHE_DIR.get()).expanduser()
    xdg = envs.XDG_CACHE_HOME.get() or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "lm-console"


def log_dir() -> Path:
    """Where the console writes its engine logs: `$LMC_LOG_DIR`, else `logs/` under the cache root."""
    if envs.LMC_LOG_DIR.is_set():
        return Path(envs.LMC_LOG_DIR.get()).expanduser()
    return cache_root() / "logs"
