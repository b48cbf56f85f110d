"""Every environment variable lm-console reads, declared once: its name, default and meaning.

Like vLLM's `vllm/envs.py`: code reads a variable through its declaration here (`envs.X.get()`,
`.is_off()`, `.as_float()`, ...) at the moment it needs it, never through `os.environ` directly, so
this file is the one list (the docs' configuration page is generated from it). Torch-free, at the
bottom of the layers: the kernels' loader and the console read it too. Variables lm-console only
*sets* for a child process or a library (TRITON_INTERPRET for Triton's interpreter, GLIBC_TUNABLES
for glibc's allocator, CUDA_VISIBLE_DEVICES for a Ray worker) are not reads and stay where they
are set.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from lm_console.engine.errors import InvalidEngineArgsError

_OFF = ("0", "false", "off")


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One environment variable: `default` applies when it is unset ("" = no value)."""

    name: str
    default: str
    help: str

    def get(self) -> str:
        """The value, or the default."""
        return os.environ.get(self.name, self.default)

    def is_set(self) -> bool:
        """Whether it has a value (set and not empty)."""
        return bool(os.environ.get(self.name))

    def is_off(self, *also: str) -> bool:
        """Whether an on/off switch is off: 0, false or off (any case), or one of `also`."""
        return self.get().lower() in (*_OFF, *also)

    def as_float(self) -> float:
        """The value as a number; a value that is not one is refused, naming the variable."""
        value = self.get()
        try:
            return float(value)
        except ValueError:
            raise InvalidEngineArgsError(f"{self.name}={value!r} must be a number ({self.help})") from None

    def as_int(self) -> int:
        """The value as an integer; a value that is not one is refused, naming the variable."""
        value = self.get()
        try:
            return int(value)
        except ValueError:
            raise InvalidEngineArgsError(f"{self.name}={value!r} must be an integer ({self.help})") from None


VARIABLES: list[EnvVar] = []


def read_named(name: str) -> str | None:
    """A variable the user names in a config file (a fleet server's `api_key_env`): not one of
    ours, so not declared; None when unset or empty."""
    return os.environ.get(name) or None


def _declare(name: str, default: str, help: str) -> EnvVar:
    variable = EnvVar(name, default, help)
    VARIABLES.append(variable)
    return variable


# -- where things are kept -------------------------------------------------------------------
LMC_CACHE_DIR = _declare(
    "LMC_CACHE_DIR", "", "the root of lm-console's cache (converted models, packed weights, compiled kernels, "
    "logs); default $XDG_CACHE_HOME/lm-console or ~/.cache/lm-console")
XDG_CACHE_HOME = _declare("XDG_CACHE_HOME", "", "the user's cache directory (freedesktop), when LMC_CACHE_DIR is unset")
XDG_CONFIG_HOME = _declare(
    "XDG_CONFIG_HOME", "", "the user's config directory (freedesktop): the fleet file lm-console/fleet.toml; "
    "default ~/.config")
LMC_LOG_DIR = _declare("LMC_LOG_DIR", "", "where the console writes its engine logs; default logs/ under the cache root")

# -- CPU kernels and the model's fast paths -------------------------------------------------
LMC_CPU_KERNELS = _declare(
    "LMC_CPU_KERNELS", "1", "0/false/off turns the C CPU kernels off: every kernel's torch path runs instead")
CC = _declare("CC", "", "the C compiler for the CPU kernels; default cc, then gcc, from PATH")
LMC_DECODE_STACK = _declare(
    "LMC_DECODE_STACK", "1", "the fused C decode step: 1 (quantized and dense bf16 models), quant (quantized only), "
    "0/off (never)")
LMC_ONEDNN_PREPACK = _declare(
    "LMC_ONEDNN_PREPACK", "1", "0/false/off: no oneDNN prepacking of dense bf16 weights")
LMC_QUANT_AUTO = _declare(
    "LMC_QUANT_AUTO", "1", "0/false/off/none/dense: quantization=None keeps dense weights instead of choosing the "
    "quantized CPU path")
LMC_QUANT_DENSE_ROWS = _declare(
    "LMC_QUANT_DENSE_ROWS", "", "from how many rows a quantized GEMM dequantizes to bf16 for oneDNN instead of the int8 "
    "kernel (default never: one path keeps outputs independent of the batch)")
LMC_QUANT_AMX = _declare(
    "LMC_QUANT_AMX", "1", "0/false/off: the quantized GEMM never uses AMX's tile unit (it does from 16 tokens where the "
    "CPU and the kernel grant it; the outputs are the same bits either way)")
LMC_LORA_KERNEL = _declare(
    "LMC_LORA_KERNEL", "auto", "the batched LoRA kernel: auto (the C kernel on the CPU, Triton on CUDA), torch (the "
    "reference), cpu, triton")
LMC_OMP_SPIN = _declare(
    "LMC_OMP_SPIN", "1000", "GOMP_SPINCOUNT the engine gives OpenMP (torch's and our kernels' one runtime) unless "
    "OMP_WAIT_POLICY or GOMP_SPINCOUNT is set: how long an idle thread spins before it sleeps; off: libgomp's own "
    "default (300000 spins: on a shared machine a thread waiting for a descheduled partner burns its core); 0: "
    "sleep at once (as OMP_WAIT_POLICY=PASSIVE)")
LMC_MALLOC_TUNING = _declare(
    "LMC_MALLOC_TUNING", "1", "0 leaves glibc's allocator settings as they are (no mallopt, no huge-page heap)")

# -- processes and start-up -------------------------------------------------------------------
LMC_MULTIPROCESS = _declare(
    "LMC_MULTIPROCESS", "1", "0: LLM runs its engine core in the calling process (EngineArgs.multiprocess's default)")
LMC_ENGINE_START_METHOD = _declare(
    "LMC_ENGINE_START_METHOD", "", "how engine-core processes start: forkserver (default where available) or spawn")
LMC_WORKER_START_METHOD = _declare(
    "LMC_WORKER_START_METHOD", "", "how tensor-parallel worker processes start: forkserver (default where available) "
    "or spawn")
LMC_ENGINE_STARTUP_TIMEOUT = _declare(
    "LMC_ENGINE_STARTUP_TIMEOUT", "900", "seconds an engine core or a worker may take to start (model conversion "
    "included) before the start fails")
LMC_STARTUP_TRACE = _declare(
    "LMC_STARTUP_TRACE", "", "anything but empty or 0: print the end of each cold-start phase with its time")

# -- the server -------------------------------------------------------------------------------
VLLM_ALLOW_RUNTIME_LORA_UPDATING = _declare(
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0", "1/true: `lmc serve --enable-lora` answers /v1/load_lora_adapter and "
    "/v1/unload_lora_adapter (vLLM's switch, same name); off, they answer 404")
# -- benchmarks --------------------------------------------------------------------------------
LMC_BENCH_HISTORY = _declare(
    "LMC_BENCH_HISTORY", "", "the JSON-lines file each benchmark run appends its figures and machine fingerprint "
    "to; default benchmarks/history.jsonl in the checkout; 0/off: none")
LMC_BENCH_BASELINES = _declare(
    "LMC_BENCH_BASELINES", "", "the folder of the perf smoke's per-machine baselines (<fingerprint id>.json); "
    "default benchmarks/baselines in the checkout")

# -- the console -----------------------------------------------------------------------------
LMC_API_KEY = _declare(
    "LMC_API_KEY", "", "the API key the console and `lmc bench serve` send to a server (--api-key's default)")

# -- Ray -----------------------------------------------------------------------------------------
RAY_ADDRESS = _declare("RAY_ADDRESS", "", "the Ray cluster to join (Ray's own variable); default a local Ray")
LMC_RAY_PLACEMENT_TIMEOUT = _declare(
    "LMC_RAY_PLACEMENT_TIMEOUT", "60", "seconds to wait for a busy Ray cluster to place an engine's workers")
LMC_RAY_WORKER_START_TIMEOUT = _declare(
    "LMC_RAY_WORKER_START_TIMEOUT", "300", "seconds a Ray worker actor may take to start and load its model")
LMC_RAY_CORE_START_TIMEOUT = _declare(
    "LMC_RAY_CORE_START_TIMEOUT", "300", "seconds a data-parallel engine core on Ray may take to start")

# -- read from other tools ---------------------------------------------------------------------
PYTHONHASHSEED = _declare(
    "PYTHONHASHSEED", "", "Python's hash seed: prefix-cache hashes with hash_algo 'builtin' agree across processes "
    "only when it is set")
OMP_WAIT_POLICY = _declare(
    "OMP_WAIT_POLICY", "", "OpenMP's wait policy (ACTIVE or PASSIVE); when set, the engine leaves OpenMP's waiting alone")
GOMP_SPINCOUNT = _declare(
    "GOMP_SPINCOUNT", "", "libgomp's spin count before an idle thread sleeps; when set, LMC_OMP_SPIN is not applied")
CUDA_VISIBLE_DEVICES = _declare("CUDA_VISIBLE_DEVICES", "", "the GPUs a process may use (CUDA's own variable)")
TRITON_INTERPRET = _declare(
    "TRITON_INTERPRET", "0", "1: Triton runs its kernels in its interpreter (on the CPU); the attention selector sets "
    "it for attention_backend='triton' on a CPU")
