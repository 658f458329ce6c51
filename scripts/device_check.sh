#!/usr/bin/env bash
# The GPU checks, on a GPU machine with no network (docs/DEVICE_RUNBOOK.md says how the wheels and model packs
# get there). Run from any directory:
#
#   scripts/device_check.sh STEP [STEP ...]
#
# Steps:
#   install    onnxruntime-gpu (its wheel, or the pieces it was split into) into $ORT_SITE, the wheels in
#              $WHEELS into $SITE; prints the ORT version and providers
#   install-sm onnxruntime-gpu cut to one GPU architecture (scripts/ort_gpu_for_sm.py: a tar.xz in pieces a0 ...
#              and its SHA256 in $ORT_SM; sm_90: one piece, carried in one call beside the tree, not six) into
#              $ORT_SITE, then the wheels as install
#   install-bridge   stock onnxruntime (the CPU wheel in $ORT_CPU, about 24 MB: one call, no pieces) into $ORT_SITE
#              and the wheels in $WHEELS into $SITE, for the `bridge` step when a machine may not last the six
#              calls that carry onnxruntime-gpu over (it cannot stand in for `install`: the native route needs it)
#   bridge     the kernels' GPU tests that need no onnxruntime-gpu: through CuPy (the fused, split-key and decode
#              kernels) and the Python op's CUDA route (float32 kernels: the shared buffer, the parity suites'
#              `cuda` cases); the native route's cases skip with their reason. Log in $OUT/bridge.log
#   gpu        every GPU test (pytest -m gpu), log in $OUT/gpu.log
#   gpu-parity, gpu-rest   the same in two halves (tests/parity and tests/claim; the others), for a machine that
#              limits one command's time; logs in $OUT/gpu-parity.log, $OUT/gpu-rest.log
#   native     the native route's GPU tests, the Python-op and parity suites' GPU cases, the cuda backend's tests
#   static     the static KV cache's GPU tests: shared-buffer parity on every GPU route, the static binding under
#              ORT's CUDA graph, device reports, the static greedy and beam loops, the split-key decode kernels
#   splitkey   the split-key decode kernels: their GPU tests (split_key_stream and the earlier pair, kernel level,
#              the native route's decode and cross-attention calls against stock ORT, under ORT's CUDA graph, the
#              static decode loops), then scripts/split_key_sweep.py's old-vs-new table, log in $OUT/splitkey.log
#   sbdecode   shared_buffer_decode (the static cache's step, shared_buffer.py shared_buffer_kernel): the shared-buffer
#              parity suite, the static decode loops and the native route's static cases on it, then the parity
#              suite on the tiled kernel (MHA_EP_SHARED_KERNEL=tiled), log in $OUT/sbdecode.log
#   sbsweep    scripts/shared_buffer_sweep.py: the static step's self-attention kernels at turbo's shapes, tiled
#              against decode, and against COMPARE's variants of shared_buffer.cu (space-separated files, e.g.
#              .device/shared_buffer_main.cu from `git show main:mha_ep/engine/cuda/kernels/shared_buffer.cu`), log in
#              $OUT/sbsweep.log
#   decodecold the decode step's attention kernels as a step runs them (docs/BENCH.md section 11, run 4): after
#              THRASH MB (default 80) read before each launch, alone and with an untimed launch of the same kernel
#              before the timed one (--warm other: its code and small buffers back in L2; --warm same: all of it),
#              split_key_stream (20 and 160 pairs, with SK_COMPARE's variants of split_keys.cu) and
#              shared_buffer_decode (B 1 and 8, with SB_COMPARE's variants of shared_buffer.cu), log in
#              $OUT/decodecold.log
#   sharedkv   static_cache's rule SHARED_CROSS_KV (--shared-cross-kv) on the GPU: the static decode loops' GPU tests
#              (the beam loop with the cross K/V one row per entry), then scripts/shared_cross_kv_ab.py at turbo B=1 and
#              B=8 and large-v3 B=1 (float16, 5 beams: per-beam cross K/V against shared, timed in turns), and
#              scripts/programmatic_ab.py at turbo B=1, log in $OUT/sharedkv.log
#   decodematmul mha_ep::DecodeMatMul (static_cache's rule DECODE_MATMUL): its GPU tests, then bench generate at turbo
#              B=1 and 8 and large-v3 B=1 (float16, profiled) with the rule off and on, into $OUT/decodematmul, and
#              scripts/decode_gemm_sweep.py (its kernel gemv_rows beside cuBLAS at turbo's shapes)
#   wstail     flash_attention_ws's tail split (dispatch.ws_tail): its GPU tests and the warp-specialized kernel's,
#              then mha-ep bench sd on the long rows (S 4096 self attention, SD3.5 / Flux joint attention; float16)
#              with the split (default) and without (MHA_EP_WS_TAIL=off), into $OUT/sd-split and $OUT/sd-off
#   threephase the parity suites on the three-phase (unfused) path
#   nbench     mha-ep bench native (ROWS=encoder,first,decode,chain), into $OUT/nbench
#   generate   mha-ep bench generate: greedy and beam Whisper generation (tiny/base/small sizes; REAL=DIR adds real
#              tiny.en, from the packs, with TOKENIZERS/whisper's config.json; DTYPE=float16 the float16 rows), into
#              $OUT/generate (or $OUT/generate-$DTYPE)
#   serving    mha-ep bench native --rows serving: a new (B, S) on every call, into $OUT/serving
#   nprofile   scripts/profile_native.py: a Whisper-sized encoder's kernels, a B=1 S=32 first call's planner
#   bench      mha-ep bench device (the encoder rows; REAL=DIR adds the real-weight rows; ONLY=TEXT the rows whose
#              label has it, SKIP=a,b columns left out), into $OUT/bench (or $OUT/bench-TEXT)
#   real       Whisper tiny.en and MiniLM from the model packs ($PACKS), tokens and embeddings vs stock ORT
#              (ROUTE=native|python-op)
#   optimum    examples/optimum_native.py's flow on the CUDA provider (wheels in $OPT_WHEELS; models from `real`)
#   demo       mha-ep demo
#   soak       mha-ep bench soak: 8 threads a session, good and bad calls mixed (SOAK_SECONDS a column in
#              SOAK_ROUNDS turns, SOAK_COLUMNS e.g. plain,session, MODEL), into $OUT/soak
#   hostpath   scripts/profile_session_graph.py: cuda_io's host time around ORT's graph replay, in segments
#   hostcalls  scripts/probe_host_calls.py: the host µs of each CUDA call a replay makes, and of alternatives
#   copykernel scripts/ab_copy_kernel.py: a replay's host time, copies by the native call, CuPy's launch or memcpy
#   twogpu     on two GPUs: tests/gpu_session/test_two_gpus.py, examples/serve_two_gpus.py and mha-ep bench soak
#              --devices 0,1 (MODEL, default BERT-base float16), into $OUT/twogpu
#   serve      mha-ep bench serve: BERT-base float16 (mha_ep/models/synthetic.py, written to $OUT/bert_base_f16.onnx
#              once) served by Ray Serve, one replica per GPU: REPLICAS=1,2 against each other, MAX_BATCH=1,16
#              (batching off, on), CLIENTS=1,16, SEQUENCE=128:128; ray[serve] and its dependencies from
#              $SERVE_WHEELS (installed into $SERVE_SITE once), into $OUT/serve
#
# Settings (environment), with their defaults:
#   WHEELS=.device/whl          onnxruntime-extensions, tokenizers, ... for the machine's Python
#   XDIST=.device/xdist         pytest-xdist and execnet wheels, installed with the others where the folder exists
#   WORKERS=                    pytest-xdist workers for the GPU tests (e.g. 12: tests/engine/cuda in under 2 minutes
#                               on an H100, against more than 5 in one process); unset: one process
#   ORT_GPU=.device/ortgpu      onnxruntime-gpu: a .whl, or pieces q0 q1 ... (split -b) joined in name order
#   ORT_SM=.device/ortsm90      onnxruntime-gpu for sm_90 only (install-sm): pieces a0 a1 ... and SHA256
#   ORT_CPU=.device/cpuwhl      stock onnxruntime's CPU wheel for the machine's Python (install-bridge)
#   ORT_WHEEL_NAME=onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl   the name the pieces rejoin as
#   SITE=/tmp/site ORT_SITE=/tmp/ortsite   where the wheels are installed (--target; nothing touches the system)
#   PACKS=".device/p0 .device/p1 .device/p2"  TOKENIZERS=.device/tok  REAL=/tmp/real   the real-weight models
#   OPT_WHEELS=.device/opt      the optimum example's wheels (transformers 4.x, optimum, optimum-onnx)
#   SERVE_WHEELS=.device/serve SERVE_SITE=/tmp/servesite   ray[serve] with its dependencies, for the serve step
#   OUT=./out                   logs, JSON and PNG files
#   REPEATS=10 ROWS=...         benchmark repeats and rows
set -u
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.device/whl}
ORT_GPU=${ORT_GPU:-.device/ortgpu}
ORT_CPU=${ORT_CPU:-.device/cpuwhl}
ORT_SM=${ORT_SM:-.device/ortsm90}
ORT_WHEEL_NAME=${ORT_WHEEL_NAME:-onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl}
SITE=${SITE:-/tmp/site}
ORT_SITE=${ORT_SITE:-/tmp/ortsite}
PACKS=${PACKS:-.device/p0 .device/p1 .device/p2}
TOKENIZERS=${TOKENIZERS:-.device/tok}
OPT_WHEELS=${OPT_WHEELS:-.device/opt}
SERVE_WHEELS=${SERVE_WHEELS:-.device/serve}
SERVE_SITE=${SERVE_SITE:-/tmp/servesite}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$ORT_SITE:$SITE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# modules loaded when a kernel of theirs first runs (CUDA 12.2+'s default, said here): install-sm's pack has zeroed
# cubins (scripts/ort_gpu_for_sm.py) that must never be loaded eagerly
export CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-LAZY}
# grep -v exits 1 when it passes no line (pip -q prints none): that is no failure of the step
quiet() { grep -v "W:onnxruntime\|WARNING: Target" || true; }
XDIST=${XDIST:-.device/xdist}
PYTEST_GPU="python3 -m pytest -q -p no:cacheprovider -m gpu${WORKERS:+ -n $WORKERS}"
# bench's output folder per ONLY= row filter, so two filtered runs in one call keep both JSON files
only_tag() { [ -n "${ONLY:-}" ] && printf -- '-%s' "$(printf '%s' "$ONLY" | tr -c 'A-Za-z0-9' '_')"; }

install_ort_gpu() {
  local wheel
  if [ -f "$ORT_GPU" ]; then
    wheel=$ORT_GPU
  elif ls "$ORT_GPU"/*.whl >/dev/null 2>&1; then
    wheel=$(ls "$ORT_GPU"/*.whl | head -1)
  elif ls "$ORT_GPU"/q* >/dev/null 2>&1; then
    wheel=$(mktemp -d)/$ORT_WHEEL_NAME
    cat $(ls "$ORT_GPU"/q* | sort) > "$wheel"
    echo "joined $(ls "$ORT_GPU"/q* | wc -l) pieces: $(sha256sum "$wheel" | cut -c1-16)..."
  else
    echo "no onnxruntime-gpu wheel or pieces in $ORT_GPU (set ORT_GPU)"; return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$ORT_SITE" "$wheel" 2>&1 | quiet
}

# the wheels of $WHEELS into $SITE, then the version and providers of the onnxruntime just installed
install_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl 2>&1 | quiet
  if ls "$XDIST"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$XDIST"/*.whl 2>&1 | quiet
  fi
  python3 -c "import onnxruntime as o; o.preload_dlls() if hasattr(o, 'preload_dlls') else None; print(o.__version__, o.get_available_providers())"
}

for step in "$@"; do
  echo "=== $step"
  case $step in
    install)
      install_ort_gpu || exit 1
      install_wheels ;;
    install-sm)
      python3 - "$ORT_SM" "$ORT_SITE" <<'EOF' || exit 1
import hashlib, io, pathlib, sys, tarfile
source, site = pathlib.Path(sys.argv[1]), sys.argv[2]
pieces = sorted(source.glob("a[0-9]*"), key=lambda p: int(p.name[1:]))
if not pieces or not (source / "SHA256").exists():
    sys.exit(f"no pieces a0 a1 ... and SHA256 in {source} (set ORT_SM; scripts/ort_gpu_for_sm.py makes them)")
data = b"".join(p.read_bytes() for p in pieces)
got, want = hashlib.sha256(data).hexdigest(), (source / "SHA256").read_text().split()[0]
if got != want:
    sys.exit(f"{len(pieces)} pieces join to {got[:16]}..., SHA256 says {want[:16]}...: a piece is missing or damaged")
with tarfile.open(fileobj=io.BytesIO(data), mode="r:xz") as tar:
    tar.extractall(site, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
print(f"joined {len(pieces)} pieces ({len(data) / 1e6:.1f} MB, {got[:16]}...) into {site}")
EOF
      install_wheels ;;
    install-bridge)
      ls "$ORT_CPU"/onnxruntime-*.whl >/dev/null 2>&1 || { echo "no onnxruntime wheel in $ORT_CPU (set ORT_CPU)"; exit 1; }
      python3 -m pip install -q --no-index --no-deps --no-compile --target "$ORT_SITE" "$ORT_CPU"/onnxruntime-*.whl 2>&1 | quiet
      install_wheels ;;
    bridge) timeout 540 $PYTEST_GPU tests/engine/cuda tests/parity/test_parity_shared_buffer.py tests/parity/test_parity_random.py \
              tests/python_op 2>&1 | tee "$OUT/bridge.log" | quiet | tail -20 ;;
    gpu) timeout 560 $PYTEST_GPU tests 2>&1 | tee "$OUT/gpu.log" | quiet | tail -30 ;;
    gpu-parity) timeout 560 $PYTEST_GPU tests/parity tests/claim 2>&1 | tee "$OUT/gpu-parity.log" | quiet | tail -20 ;;
    gpu-rest) timeout 560 $PYTEST_GPU tests --ignore=tests/parity --ignore=tests/claim 2>&1 | tee "$OUT/gpu-rest.log" \
                | quiet | tail -20 ;;
    native) timeout 540 $PYTEST_GPU tests/native tests/python_op tests/engine/cuda/test_cuda_backend.py tests/engine/cuda/test_cuda_layout.py \
              tests/parity tests/claim/test_bad_input.py 2>&1 \
              | tee "$OUT/native.log" | quiet | tail -40 ;;
    static) timeout 540 $PYTEST_GPU tests/native/test_native_cuda.py tests/decode/test_static_decode.py \
              tests/parity/test_parity_shared_buffer.py tests/claim/test_bad_input.py tests/engine/cuda/test_fused_kernels.py \
              -k "static or shared or past_sequence or cache_indirection or bad_past or split" 2>&1 \
              | tee "$OUT/static.log" | quiet | tail -40 ;;
    splitkey) { timeout 420 $PYTEST_GPU tests/engine/cuda/test_fused_kernels.py tests/native/test_native_cuda.py \
                  tests/parity/test_parity_random.py tests/decode/test_static_decode.py \
                  -k "split or decode or cross or graph or static" 2>&1 | quiet | tail -30
                timeout 170 python3 scripts/split_key_sweep.py 2>&1; } | tee "$OUT/splitkey.log" ;;
    sbdecode) { timeout 200 $PYTEST_GPU tests/parity/test_parity_shared_buffer.py tests/decode/test_static_decode.py \
                  tests/native/test_native_cuda.py -k "static or shared or past_sequence or cache_indirection" 2>&1 \
                  | quiet | tail -8
                MHA_EP_SHARED_KERNEL=tiled timeout 120 $PYTEST_GPU tests/parity/test_parity_shared_buffer.py 2>&1 \
                  | quiet | tail -4
              } | tee "$OUT/sbdecode.log" ;;
    sbsweep) timeout 200 python3 scripts/shared_buffer_sweep.py ${COMPARE:+--compare $COMPARE} 2>&1 \
               | tee "$OUT/sbsweep.log" ;;
    decodecold) { for warm in "" other same; do
                    timeout 120 python3 scripts/split_key_sweep.py --pairs 20,160 --no-bias --thrash "${THRASH:-80}" \
                      ${warm:+--warm $warm} ${SK_COMPARE:+--compare $SK_COMPARE} 2>&1 | grep -v "^|---\|Warning\|warn"
                    timeout 120 python3 scripts/shared_buffer_sweep.py --batches 1,8 --beams 0 --past 35 \
                      --thrash "${THRASH:-80}" ${warm:+--warm $warm} ${SB_COMPARE:+--compare $SB_COMPARE} 2>&1 \
                      | grep -v "^|---\|Warning\|warn"
                  done; } | tee "$OUT/decodecold.log" ;;
    sharedkv) { timeout 120 $PYTEST_GPU tests/decode/test_static_decode.py 2>&1 | quiet | tail -3
                for row in "turbo 1" "turbo 8" "large-v3 1"; do
                  set -- $row
                  timeout 200 python3 scripts/shared_cross_kv_ab.py --size "$1" --batch "$2" 2>&1 | grep "ms/step"
                done
                timeout 120 python3 scripts/programmatic_ab.py --size turbo --batch 1 2>&1 | grep "ms/step"
              } | tee "$OUT/sharedkv.log" ;;
    decodematmul) timeout 120 $PYTEST_GPU tests/native/test_decode_matmul.py 2>&1 | quiet | tail -3
                  for size in turbo large-v3; do
                    timeout 400 python3 -m mha_ep bench generate --sizes "$size" \
                      --batches "$([ "$size" = turbo ] && echo 1,8 || echo 1)" --dtype float16 \
                      --columns stock_iobinding,mhaep_plain,static_greedy --decode-matmul both --profile --repeats 3 \
                      --steps 64 --out "$OUT/decodematmul-$size" 2>&1 | quiet | grep "^| Whisper"
                  done
                  timeout 240 python3 scripts/decode_gemm_sweep.py --rows 1,5,8 --repeats 5 2>&1 | quiet \
                    | tee "$OUT/decodematmul-gemms.log" | grep "^|" ;;
    wstail) { timeout 200 $PYTEST_GPU tests/engine/cuda/test_fused_kernels.py -k "tail or warp_specialized" 2>&1 \
                | quiet | tail -3
              for tail in split off; do
                MHA_EP_WS_TAIL=$tail timeout 150 python3 -m mha_ep bench sd --repeats "${REPEATS:-20}" \
                  --dtypes float16 --only "L4096,joint" --out "$OUT/sd-$tail" 2>&1 | quiet | grep "^| SD\|^| Flux"
              done; } | tee "$OUT/wstail.log" ;;
    threephase) MHA_EP_THREE_PHASE=1 timeout 200 $PYTEST_GPU tests/parity 2>&1 | quiet | tail -4 ;;
    nbench) timeout 540 python3 -m mha_ep bench native --repeats "${REPEATS:-10}" \
              --rows "${ROWS:-encoder,first,decode,chain}" --out "$OUT/nbench" 2>&1 | quiet ;;
    generate)
      extra=()
      if [ -n "${REAL:-}" ]; then
        [ -d "$REAL" ] || python3 scripts/device_models.py unpack $PACKS --out "$REAL" | tail -2
        extra=(--models "$REAL" --whisper-config "$TOKENIZERS/whisper")
      fi
      timeout 540 python3 -m mha_ep bench generate --repeats "${REPEATS:-3}" --steps "${STEPS:-64}" "${extra[@]}" \
        --dtype "${DTYPE:-float32}" --out "$OUT/generate${DTYPE:+-$DTYPE}" 2>&1 | quiet ;;
    serving) timeout 200 python3 -m mha_ep bench native --rows serving --calls "${CALLS:-60}" --out "$OUT/serving" 2>&1 | quiet ;;
    nprofile) timeout 300 python3 scripts/profile_native.py kernels "Whisper-tiny" 2>&1 | quiet | tail -60
              timeout 200 python3 scripts/profile_native.py planner "B=1 S=32" 2>&1 | quiet | head -60 ;;
    bench)
      if [ -n "${REAL:-}" ] && [ ! -d "$REAL" ]; then
        python3 scripts/device_models.py unpack $PACKS --out "$REAL" | tail -2
      fi
      if [ -n "${REAL:-}" ]; then extra=(--models-dir "$REAL"); else extra=(--rows encoder); fi
      timeout 500 python3 -m mha_ep bench device --repeats "${REPEATS:-10}" --rows "${ROWS:-all}" "${extra[@]}" \
        --skip "${SKIP:-}" --only "${ONLY:-}" --out "$OUT/bench$(only_tag)" 2>&1 | quiet ;;
    real) timeout 400 python3 scripts/device_real_models.py --packs $PACKS --tokenizers "$TOKENIZERS" --backend cuda \
            --route "${ROUTE:-native}" --out "${REAL:-/tmp/real}" 2>&1 | quiet | tail -40 ;;
    optimum)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/opt "$OPT_WHEELS"/*.whl 2>&1 | quiet
      PYTHONPATH=/tmp/opt:$PYTHONPATH timeout 200 python3 scripts/device_optimum.py --models "${REAL:-/tmp/real}" \
        --tokenizers "$TOKENIZERS" 2>&1 | quiet | tail -12 ;;
    demo) timeout 200 python3 -m mha_ep demo 2>&1 | quiet | tail -15 ;;
    soak) timeout 400 python3 -m mha_ep bench soak --seconds "${SOAK_SECONDS:-30}" --rounds "${SOAK_ROUNDS:-5}" \
            --columns "${SOAK_COLUMNS:-stock,plain,session,session_graphs}" \
            --model "${MODEL:-bert_random_mask2d_fp32.onnx}" --out "$OUT/soak" 2>&1 | quiet | tail -12 ;;
    hostpath) timeout 300 python3 scripts/profile_session_graph.py --repeats "${REPEATS:-15}" 2>&1 | quiet | tail -14 ;;
    hostcalls) timeout 120 python3 scripts/probe_host_calls.py 2>&1 | quiet | tail -14 ;;
    copykernel) timeout 300 python3 scripts/ab_copy_kernel.py 2>&1 | quiet | tail -9 ;;
    twogpu)
      timeout 200 $PYTEST_GPU tests/gpu_session/test_two_gpus.py 2>&1 | quiet | tail -5
      timeout 120 python3 examples/serve_two_gpus.py 2>&1 | quiet | tail -3
      timeout 300 python3 -m mha_ep bench soak --devices 0,1 --seconds "${SOAK_SECONDS:-30}" --threads 4 \
        --model "${MODEL:-bert-base-f16}" --batches 8,16,32 --max-sequence 256 --out "$OUT/twogpu" 2>&1 \
        | quiet | tail -6 ;;
    serve)
      [ -d "$SERVE_SITE/ray" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$SERVE_SITE" \
        "$SERVE_WHEELS"/*.whl 2>&1 | quiet
      PYTHONPATH=$SERVE_SITE:$PYTHONPATH timeout 580 python3 -m mha_ep bench serve --make-bert-base float16 \
        --model "$OUT/bert_base_f16.onnx" --backend cuda --providers cuda --replicas "${REPLICAS:-1,2}" \
        --max-batch "${MAX_BATCH:-1,16}" --clients "${CLIENTS:-1,16}" --sequence "${SEQUENCE:-128:128}" \
        --duration "${DURATION:-10}" --warmup "${WARMUP:-8}" --out "$OUT/serve" 2>&1 | quiet ;;
    *) echo "unknown step $step (see the top of $0)"; exit 2 ;;
  esac
done
