#!/usr/bin/env bash
# CUDA checks of fqnckpt: on every visible GPU, with NCCL, the parallel module against
# eager, a checkpoint saved from and loaded straight into CUDA DTensors (pinned host buffers,
# copies overlapped with reads; resharded too), and async_save from CUDA (pinned staging), with
# GB/s against a plain safe_open + .to("cuda") reference (tests/gpu/checks.py).
#
#   tests/gpu/run.sh [--mib 1024] [--rounds 3] [--dir DIR] [--pytest]
#
# --pytest also runs the CPU (gloo) parallel-module and checkpoint test files afterwards.
# Without CUDA it says so and exits 0; tests/test_gpu_script.py runs it that way in CI, and runs
# checks.py on CPU ranks (gloo) to keep the script's own code working.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root" || exit 1
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python}"
run_pytest=0
args=()
for a in "$@"; do
  if [ "$a" = "--pytest" ]; then run_pytest=1; else args+=("$a"); fi
done
n="$("$py" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null)"
n="${n:-0}"
if [ "$n" = "0" ]; then
  echo "tests/gpu/run.sh: no CUDA device visible (torch.cuda.is_available() is False): GPU checks skipped"
  exit 0
fi
command -v nvidia-smi >/dev/null && nvidia-smi -L
echo "tests/gpu/run.sh: $n CUDA device(s); NCCL $("$py" -c 'import torch.distributed as d; print(d.is_nccl_available())')"
status=0
"$py" tests/gpu/checks.py --device cuda --world "$n" "${args[@]}" || status=1
if [ "$run_pytest" = "1" ]; then
  "$py" -m pytest -q -p no:cacheprovider tests/test_autoparallel_ranks.py tests/test_checkpoint_dist.py \
    tests/test_training_async_save.py tests/test_device_load.py || status=1
fi
echo "tests/gpu/run.sh: $([ $status = 0 ] && echo OK || echo FAILED)"
exit $status
