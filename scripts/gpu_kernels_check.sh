#!/usr/bin/env bash
# One-command check of the pure-PyTorch kernels on a GPU machine that has only torch
# (no vLLM, no network): the operator's selftest (`python -m vllm_bi100_patch selftest`: the
# reduced reference grid on the GPU, timings, projection), then the benchmark's GPU cases
# (with every call's account and modelled time), then the real launches (torch.profiler)
# and time per call next to the model's (the first GPU run calibrates the model), then one
# summary block.  Installs nothing: the repository goes on PYTHONPATH.
#
#   scripts/gpu_kernels_check.sh            # on the GPU machine (CUDA device 0)
#   scripts/gpu_kernels_check.sh --dry-run  # same steps on CPU with tiny sizes (seconds)
#
# Environment: PYTHON (default python3), BI100_CHECK_OUT (default ./gpu-kernels-check).
# Exit status: 0 when every check passed and the benchmark ran, 1 otherwise.
# Budget: under 9 minutes on one GPU (selftest 150 s, benchmark 240 s, profile 120 s at most).
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
OUT="${BI100_CHECK_OUT:-$PWD/gpu-kernels-check}"
DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg (expected --dry-run)" >&2; exit 2 ;;
  esac
done

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
mkdir -p "$OUT"
start=$(date +%s)

if [ "$DRY" = 1 ]; then
  # The cheap checks only: on a CPU the GPU formulation's half-precision products are
  # emulated where the CPU has no float16 instructions, and tests/attention/kernels/test_device.py
  # runs every check in that formulation already.
  SELFTEST_ARGS=(--device cpu --formulation gpu --quick --repeats 1 --check check_formulation
                 --check check_logit_precision --check check_gqa_window_alibi
                 --check check_unattended_slots --check check_fp8_cache
                 --check check_decode_batch_invariance --check check_cuda_no_sync_and_budget)
  BENCH_ARGS=(--device cpu --quick --repeats 1 --no-curve)
  PROFILE_ARGS=(--device cpu --quick --calls 1 --repeats 1)
else
  SELFTEST_ARGS=(--device cuda --time-limit 120)
  BENCH_ARGS=(--device cuda --repeats 5 --no-curve)
  PROFILE_ARGS=(--device cuda --calls 3 --repeats 10)
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_kernels_check: torch sees no CUDA device (use --dry-run on CPU)" >&2
    exit 1
  fi
fi

"$PY" -c 'import torch; d = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"; print(f"torch {torch.__version__}, device: {d}")' \
  | tee "$OUT/env.txt"

# 1. The operator's selftest (the same command a server runs before serving: the reduced
#    reference grid on the device, decode/prefix timings with their account, projection),
#    in the GPU formulation on CPU for --dry-run.  Its JSON goes beside the table.
timeout 150 "$PY" -m vllm_bi100_patch selftest "${SELFTEST_ARGS[@]}" \
  --json-out "$OUT/selftest.json" 2>"$OUT/selftest.log" | tee "$OUT/checks.txt"
checks_rc=${PIPESTATUS[0]}

# 2. The benchmark: decode 32K/128K tokens (KV read vs copy bandwidth), tiled prefix
#    1x(32K+512) and 4x(8K+256) against dense SDPA (quick CPU shapes for --dry-run).
timeout 240 "$PY" "$ROOT/scripts/bench_attention.py" "${BENCH_ARGS[@]}" --out "$OUT/bench" 2>&1 \
  | tee "$OUT/bench.txt"
bench_rc=${PIPESTATUS[0]}

# 3. Real launches (torch.profiler) and time per call next to the model, field shape and
#    the benchmark's GPU cases (small field-shape cases on CPU for --dry-run).
timeout 120 "$PY" "$ROOT/scripts/profile_kernels.py" "${PROFILE_ARGS[@]}" 2>&1 \
  | tee "$OUT/profile.txt"
profile_rc=${PIPESTATUS[0]}

elapsed=$(( $(date +%s) - start ))
status=PASS
if [ "$checks_rc" != 0 ] || [ "$bench_rc" != 0 ] || [ "$profile_rc" != 0 ]; then
  status=FAIL
fi
{
  echo "==== gpu_kernels_check summary ===="
  cat "$OUT/env.txt"
  grep -E '^selftest on ' "$OUT/checks.txt" || { echo "selftest: no result (exit $checks_rc)"; tail -5 "$OUT/selftest.log"; }
  grep -E '^measured copy bandwidth' "$OUT/bench.txt" || true
  grep -E '^model ' "$OUT/bench.txt" || true
  grep -E '^(## |\| (case|decode|prefix|dense))' "$OUT/bench.txt" \
    || echo "benchmark: no table (exit $bench_rc)"
  grep -E '^target ' "$OUT/bench.txt" || true
  echo "## launches and time per call: profiled vs modelled"
  grep -E '^(profile_kernels:|\| |calibration:)' "$OUT/profile.txt" \
    || echo "profile: no table (exit $profile_rc)"
  echo "selftest exit $checks_rc, benchmark exit $bench_rc, profile exit $profile_rc, ${elapsed} s;" \
    "outputs in $OUT"
  echo "RESULT: $status"
} | tee "$OUT/summary.txt"
[ "$status" = PASS ]
