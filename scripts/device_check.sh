#!/usr/bin/env bash
# GPU checks on the lent H200 in few calls (docs/DEVICE_RUNBOOK.md says how the wheels and packs get there).
#   scripts/device_check.sh install            onnxruntime-gpu from /tmp/og/q? (+ .device/og5/q4 when carried) into
#                                              /tmp/ortsite, .device/whl/*.whl into /tmp/site
#   scripts/device_check.sh STEP [STEP ...]    with both on PYTHONPATH; steps:
#     gpu        every GPU test (-m gpu), log in $OUT/gpu.log
#     device     the device-mode tests and the parity suites' device-mode cases
#     native     the native route's GPU tests, the parity suites' cuda-native cases, the cuda backend's tests
#     nbench     mha-ep bench native (ROWS=encoder,first,decode,chain), $OUT/nbench
#     nprofile   scripts/profile_native.py: the Whisper-sized encoder's kernels, the B=1 S=32 first call's planner
#     optimum    examples/optimum_native.py on the CUDA provider (transformers 4.x from .device/opt; the MiniLM
#                model unpacked into $REAL by the real step)
#     threephase the parity suites on the three-phase path
#     bench      mha-ep bench device (the encoder rows; REAL=/tmp/real adds the real-weight rows), $OUT/bench
#     real       Whisper tiny.en and MiniLM in device mode from the packs in /tmp/pk/p0 /tmp/pk/p1 .device/p2
#     demo       mha-ep demo
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:/tmp/ortsite:/tmp/site PYTHONUNBUFFERED=1
quiet() { grep -v "W:onnxruntime\|WARNING: Target"; }
for step in "$@"; do
  echo "=== $step"
  case $step in
    install)
      [ -f .device/og5/q4 ] && cp .device/og5/q4 /tmp/og/
      cat /tmp/og/q? > /tmp/og/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ortsite /tmp/og/*.whl 2>&1 | quiet
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/whl/*.whl 2>&1 | quiet
      python3 -c "import onnxruntime as o; o.preload_dlls(); print(o.__version__, o.get_available_providers())" ;;
    gpu) timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee $OUT/gpu.log | quiet | tail -30 ;;
    device) timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_device_mode.py tests/test_parity_grid.py \
              tests/test_bad_input.py tests/test_parity_random.py -k "cuda-device or device_mode" 2>&1 | quiet | tail -15 ;;
    native) timeout 540 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_native.py tests/test_cuda_backend.py \
              tests/test_cuda_layout.py tests/test_parity_grid.py tests/test_parity_random.py tests/test_bad_input.py \
              tests/test_robustness.py tests/test_edge_cases.py -k "not cuda-device" 2>&1 | tee $OUT/native.log | quiet | tail -40 ;;
    nbench) timeout 540 python3 -m mha_ep bench native --repeats "${REPEATS:-10}" --rows "${ROWS:-encoder,first,decode,chain}" \
              --out $OUT/nbench 2>&1 | quiet ;;
    nprofile) timeout 300 python3 scripts/profile_native.py kernels "Whisper-tiny" 2>&1 | quiet | tail -60
              timeout 200 python3 scripts/profile_native.py planner "B=1 S=32" 2>&1 | quiet | head -60 ;;
    optimum)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/opt .device/opt/*.whl 2>&1 | quiet
      PYTHONPATH=/tmp/opt:$PYTHONPATH timeout 200 python3 scripts/device_optimum.py --models "${REAL:-/tmp/real}" \
        --tokenizers .device/tok 2>&1 | quiet | tail -12 ;;
    threephase) MHA_EP_THREE_PHASE=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_parity_grid.py \
              tests/test_parity_random.py 2>&1 | quiet | tail -4 ;;
    bench)
      if [ -n "${REAL:-}" ]; then
        python3 scripts/device_models.py unpack /tmp/pk/p0 /tmp/pk/p1 .device/p2 --out "$REAL" | tail -2
        extra=(--models-dir "$REAL")
      else
        extra=(--rows encoder)
      fi
      timeout 500 python3 -m mha_ep bench device --repeats "${REPEATS:-10}" --rows "${ROWS:-all}" "${extra[@]}" \
        --out $OUT/bench 2>&1 | quiet ;;
    real) timeout 400 python3 scripts/device_real_models.py --packs /tmp/pk/p0 /tmp/pk/p1 .device/p2 \
            --tokenizers .device/tok --backend cuda --device-mode "${MODE:-device}" --out "${REAL:-/tmp/real}" 2>&1 \
            | quiet | tail -40 ;;
    demo) timeout 200 python3 -m mha_ep demo 2>&1 | quiet | tail -15 ;;
    *) echo "unknown step $step" ;;
  esac
done
