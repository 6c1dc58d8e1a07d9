#!/usr/bin/env bash
# Issue 44's device checks in one run, for a session lent a machine with one CUDA GPU (15
# minutes of device time in all, start-up included): the host-sync test, the GPU tests and
# `benchmarks.gpu`, with the machine's own torch and gradsync from this checkout. Everything
# lands in $OUT (the device tool brings it back): device.txt, tests.log and bench.log, whose
# markdown is the section to paste into BENCHMARKS.md ("gradsync on one GPU").
#
# From the repository's root, through the device tool:  bash benchmarks/gpu_session.sh
# Budget: the tests stop at TESTS_S, the benchmark at BENCH_S (defaults 240 and 360 seconds),
# so the run ends inside one 10-minute command with time left to rerun a part.
set -u
OUT=${OUT:-/tmp/gradsync-gpu}
TESTS_S=${TESTS_S:-240}
BENCH_S=${BENCH_S:-360}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 - <<'PY' 2>&1 | tee "$OUT/device.txt"
import torch
assert torch.cuda.is_available(), "no CUDA device: run this on the lent GPU machine"
print(torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$OUT/device.txt" 2>&1
# every test that needs a CUDA device (the ones CI skips), -rA: the messages of a run cut short
timeout "$TESTS_S" python3 -m pytest -q -rA -p no:cacheprovider tests/unit/test_host_reads_cuda.py \
    tests/*/test_gpu*.py 2>&1 | tee "$OUT/tests.log"
timeout "$BENCH_S" python3 -m benchmarks.gpu --repeats 5 --steps 20 --calls 20 2>&1 |
    tee "$OUT/bench.log"
echo "tests: $(tail -n 1 "$OUT/tests.log")"
