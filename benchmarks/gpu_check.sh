#!/usr/bin/env bash
# The GPU check of the kernels and the CUDA runner, sized for one device call (< 8 minutes).
#
#   bash benchmarks/gpu_check.sh                    # on the GPU machine, from a copy of the repo
#   bash benchmarks/gpu_check.sh --download-wheels  # once, where pip can reach PyPI (see below)
#
# 1. pytest tests/kernels (+ the backend-level tests of tests/attention/test_triton_backend.py)
#    on the GPU: real sizes, every kernel against a float64 reference.
# 2. benchmarks/gpu_kernels.py: decode attention bandwidth (unified and split-KV kernels) against
#    the copy bandwidth measured in the same run and the H200's ~4.3 TB/s; prefill attention
#    against torch SDPA; fused add + RMSNorm against eager torch.
# 3. benchmarks/gpu_e2e.py: greedy tokens equal through the torch backend, the Triton backend
#    eager and with CUDA graphs (tiny Qwen3, fp32); then nano-vllm's workload (256 requests,
#    input and output lengths uniform in [100, 1024], ignore_eos) on a Qwen3-0.6B-shaped
#    random-weight model, output tok/s with CUDA graphs on and off.
# Prints a short table last; full numbers and the log go to $OUT (default ./gpu_check_out).
#
# The machine runs its own python3 (torch, triton, transformers, pytest are there). The engine
# also needs msgspec, pyzmq and cbor2: `--download-wheels` saves cp312 wheels of them into .whl/
# (git-ignored); carry .whl to the machine and they are installed into /tmp/site. Without them,
# stages 1-2 still run and stage 3 is skipped. Each stage gets a share of GPU_CHECK_BUDGET_S
# (default 450 s) and is cut off by `timeout`, so the script ends in time whatever happens.
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [[ "${1:-}" == "--download-wheels" ]]; then
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl msgspec==0.23.0 pyzmq==27.3.0 cbor2==6.3.0
fi

OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
: >"$LOG"
BUDGET_S=${GPU_CHECK_BUDGET_S:-450}
START=$SECONDS
# stage_timeout CAP RESERVE: at most CAP seconds, leaving RESERVE for the stages after it.
stage_timeout() {
    local t=$((BUDGET_S - (SECONDS - START) - $2))
    ((t > $1)) && t=$1
    ((t < 20)) && t=20
    echo "$t"
}
log() { echo "[gpu_check $((SECONDS - START))s] $*" | tee -a "$LOG"; }

export PYTHONUNBUFFERED=1 PYTHONHASHSEED=0 LMC_MULTIPROCESS=0
unset TRITON_INTERPRET
SMOKE=()  # GPU_CHECK_SMOKE=1: tiny sizes on CPU, to check this script without a GPU
if [[ "${GPU_CHECK_SMOKE:-0}" == 1 ]]; then
    SMOKE=(--smoke)
    export TRITON_INTERPRET=1
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | tee -a "$LOG"
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"

log "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv \
    2>&1 | tee -a "$LOG"
"$PY" -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch',
torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__,
'cuda', torch.cuda.is_available())" 2>&1 | tee -a "$LOG"
ENGINE_OK=1
"$PY" -c "import msgspec, zmq, cbor2" 2>>"$LOG" || {
    ENGINE_OK=0
    log "msgspec/pyzmq/cbor2 missing (carry .whl, see --download-wheels): engine stages skipped"
}

log "1/3 kernel tests on the GPU (real sizes, float64 references)"
TESTS=(tests/kernels)
((ENGINE_OK)) && TESTS+=(tests/attention/test_triton_backend.py)
timeout "$(stage_timeout 130 300)" "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" \
    -k "not tiny_model" --junitxml="$OUT/tests.xml" 2>&1 | tee -a "$LOG"
TESTS_RC=${PIPESTATUS[0]}
TESTS_LINE=$(grep -E "(passed|failed|error)" "$LOG" | tail -1)

log "2/3 kernel timings"
timeout "$(stage_timeout 80 220)" "$PY" benchmarks/gpu_kernels.py --out "$OUT" \
    ${SMOKE[@]+"${SMOKE[@]}"} 2>&1 | tee -a "$LOG"

if ((ENGINE_OK)); then
    log "3/3 end to end: exactness, then nano-vllm's workload with CUDA graphs on and off"
    E2E_S=$(stage_timeout 400 15)
    timeout "$E2E_S" "$PY" benchmarks/gpu_e2e.py --out "$OUT" --budget-s $((E2E_S - 5)) \
        ${SMOKE[@]+"${SMOKE[@]}"} 2>&1 | tee -a "$LOG"
fi

log "summary"
TESTS_RC=$TESTS_RC TESTS_LINE=$TESTS_LINE "$PY" - "$OUT" <<'EOF' 2>&1 | tee "$OUT/summary.txt"
import json, os, sys
from pathlib import Path

out = Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None

print("=" * 78)
rc = os.environ.get("TESTS_RC")
print(f"kernel tests (GPU, real sizes): exit {rc}: {os.environ.get('TESTS_LINE', '').strip()}")
k = load("kernels.json")
if k:
    print(f"device {k['device']}, torch {k['torch']}, triton {k['triton']}, {k['dtype']}; "
          f"copy bandwidth {k['copy_tb_s']:.2f} TB/s (H200 ~4.3)")
    print("decode   B x ctx     H/Hkv kernel   ms      TB/s  of 4.3TB/s")
    for d in k["decode"]:
        print(f"       {d['num_seqs']:>3} x {d['context']:<6} {d['heads']}/{d['kv_heads']:<2}"
              f"  {d['backend_choice']:<7} {d['backend_ms']:7.3f} {d['backend_tb_s']:6.2f} "
              f"{100 * d['backend_tb_s'] / 4.3:7.1f}%")
    print("prefill  B x len     H/Hkv  ours ms  SDPA ms  ours/SDPA time")
    for p in k["prefill"]:
        print(f"       {p['num_seqs']:>3} x {p['length']:<6} {p['heads']}/{p['kv_heads']:<2}"
              f" {p['ours_ms']:8.3f} {p['sdpa_ms']:8.3f} {p['ours_over_sdpa_time']:8.2f}")
else:
    print("kernel timings: missing (see gpu_check.log)")
e = load("e2e_exact.json")
print(f"greedy exactness (tiny Qwen3, fp32): {e if e else 'missing'}")
for name in ("graphs", "eager"):
    r = load(f"e2e_{name}.json")
    if r:
        note = " (PARTIAL: stopped at its deadline)" if r["partial"] else ""
        print(f"nano-vllm workload, CUDA graphs {'on ' if r['cuda_graphs'] else 'off'}: "
              f"{r['output_tok_s']:8.0f} output tok/s ({r['output_tokens']} tokens in "
              f"{r['seconds']:.1f} s, {r['num_kv_blocks']} KV blocks){note}")
    else:
        print(f"nano-vllm workload, {name}: missing (see gpu_check.log)")
EOF
log "done; files in $OUT"
