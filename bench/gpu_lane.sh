#!/usr/bin/env bash
# One GPU step of the H200 lane (docs/GPU_RESULTS.md keeps the current results): environment
# probe, the benchmark (bench/bench_gpu.py) and the cuDNN-backend GPU tests. Logs and results go
# to $OUT. Run from the repository root with torch (CUDA), triton and nvidia-cudnn-frontend
# importable (pip install -e '.[test,gpu]').
#   BENCH_T="4096 8192"  BENCH_TIMEOUT=200  TEST_TIMEOUT=280  TESTS="-m gpu -k cudnn"
set -o pipefail
OUT=${OUT:-/tmp/lane-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  date -u
  git log -1 --format='commit %H' 2>/dev/null || true
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
  python3 -c "import torch, triton, cudnn; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn-fe', cudnn.__version__, 'backend', cudnn.backend_version(), 'cc', torch.cuda.get_device_capability())"
} 2>&1 | tee "$OUT/probe.log"
if [ "${BENCH_TIMEOUT:-200}" != 0 ]; then
  timeout "${BENCH_TIMEOUT:-200}" python3 bench/bench_gpu.py --T ${BENCH_T:-4096 8192} \
    ${BENCH_ARGS:-} --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | grep -v '^{' | tail -60
fi
if [ "${TEST_TIMEOUT:-280}" != 0 ]; then
  timeout "${TEST_TIMEOUT:-280}" python3 -m pytest ${TESTS:--m gpu -k cudnn} -p no:cacheprovider \
    -rA --timeout=240 -v oracle_tests > "$OUT/pytest.log" 2>&1
  echo "pytest exit $?"
  grep -E " (PASSED|FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | cut -c1-220 | tail -70
fi
