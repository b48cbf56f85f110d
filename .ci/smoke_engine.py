"""Packaging smoke test of an installed lm-console[engine] (run by .ci/package_check.sh).

`lmc generate` on the embedded model with an empty cache (it converts the model from its GGUF, the
first-use path a filled cache skips): the engine process must compile the C attention kernels
from the sources installed with the package (a wheel without them falls
back to torch, with a warning, and compiles nothing). Then each C kernel library loads here too.
Run it from outside the checkout so that `import lm_console.kernels` finds the installed copy.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from lm_console import kernels
from lm_console.kernels import cpu_attention, cpu_ops, cpu_sampling

PROMPT = "The capital of France is"


def fresh_cache(root: Path) -> dict[str, str]:
    """LMC_CACHE_DIR at `root`: no compiled kernels, no converted model (a user's first run)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LMC_CPU_KERNELS", "PYTHONPATH")}
    env["LMC_CACHE_DIR"] = str(root)
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path (and its C kernels) on a GPU machine too
    return env


def main() -> None:
    prefix = Path(sys.prefix).resolve()
    assert prefix in Path(kernels.__file__).resolve().parents, f"kernels imported from {kernels.__file__}"
    # Hugging Face's `kernels` (a dependency of transformers >= 5.25) installs beside our wheel, and
    # transformers' integration imports it, not a package of ours.
    hub = subprocess.run([sys.executable, "-c", "import transformers.integrations.hub_kernels, kernels; "
                          "print(kernels.__file__)"], capture_output=True, text=True, timeout=300)
    assert hub.returncode == 0, hub.stderr[-4000:]
    print(f"transformers' hub kernels import {hub.stdout.strip()}")
    lmc = Path(sys.executable).parent / "lmc"
    with tempfile.TemporaryDirectory() as tmp:
        env = fresh_cache(Path(tmp))
        result = subprocess.run([str(lmc), "generate", PROMPT, "--max-tokens", "8"], env=env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-4000:]
        assert result.stdout.strip(), "lmc generate printed nothing"
        assert "torch path" not in result.stderr, result.stderr[-4000:]
        built = sorted(p.name for p in (Path(tmp) / "kernels").glob("*.so"))
        assert any(name.startswith("paged_attention-") for name in built), f"no attention kernel built: {built}"
        print(f"lmc generate {PROMPT!r} -> {result.stdout.strip()!r}; the engine built {built}")
    for module in (cpu_attention, cpu_ops, cpu_sampling):
        sources = getattr(module, "SOURCES", None) or (module.SOURCE,)
        assert all(prefix in Path(s).resolve().parents and Path(s).is_file() for s in sources), sources
        assert module.load() is not None, f"{module.__name__}: the C kernels did not load"
    print("engine smoke test passed: C kernels compiled from the installed sources and loaded")


if __name__ == "__main__":
    main()
