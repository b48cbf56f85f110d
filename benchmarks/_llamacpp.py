"""llama.cpp (llama-cpp-python) as the benchmarks load it: with its fastest CPU path where that path runs.

ggml repacks weights for AMX on CPUs that report AMX ("extra buffer types"). On a VM whose CPU
reports AMX but faults on the tile instructions (seen on a 2-core Sapphire Rapids VM in
2026-12: SIGILL in ggml_backend_amx_mul_mat on the first batch of more than a few tokens, with
the tile permission granted), llama.cpp dies. `prepare(gguf)` runs one prompt of a few hundred
tokens in a child process first; if that dies of SIGILL, this process's llama.cpp models load
without the extra buffer types (its AVX-512 path), and the returned note says so, for the report.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

_PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=1024, n_batch=512, n_threads=1, verbose=False)
llm.eval(list(range(10, 310)))
"""


def prepare(gguf: Path) -> str | None:
    """Make llama.cpp usable in this process on this CPU; a note for the report when its AMX
    path had to be turned off, else None. ImportError when llama-cpp-python is absent."""
    import llama_cpp
    import llama_cpp.llama_cpp as low_level  # what llama_cpp.Llama calls

    probe = subprocess.run([sys.executable, "-c", _PROBE, str(gguf)], capture_output=True, timeout=300)
    if probe.returncode != -signal.SIGILL:
        return None
    defaults = low_level.llama_model_default_params

    def without_extra_buffer_types():  # noqa: ANN202 - llama_cpp's ctypes struct
        params = defaults()
        params.use_extra_bufts = False
        return params

    low_level.llama_model_default_params = without_extra_buffer_types
    llama_cpp.llama_model_default_params = without_extra_buffer_types  # the package re-exports it
    return ("llama.cpp's AMX weight repack faulted (SIGILL) on this CPU; it ran with use_extra_bufts=False "
            "(its AVX-512 path)")
