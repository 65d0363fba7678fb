#!/bin/sh
# A crash hunt under AddressSanitizer, without rebuilding anything: libasan is preloaded
# (with libstdc++, else ASan's __cxa_throw interceptor finds no real one and aborts in torch's
# first C++ throw) into the launcher, its forkserver and every rank, and Python allocates through
# malloc so its objects get ASan's redzones and quarantine. Uninstrumented code (torch, gloo,
# CPython) is checked where it goes through libc: preadv / pread / read / recv into freed or
# out-of-bounds memory, memcpy / memset / memmove, and every double free, reported with the
# allocation and free stacks in $ASAN_DIR/asan.log.PID. Not a test; from the repo root:
#
#     sh tests/repro/asan_loop.sh 2 24    # world size, runs (about 40 s a run here, 70 s for 4)
#
# Measured: 24 runs of the 2-rank and 20 of the 4-rank spawn, no report.
set -eu
world=${1:-2}
runs=${2:-10}
ASAN_DIR=${ASAN_DIR:-/tmp/fqnckpt-asan}
mkdir -p "$ASAN_DIR"
libasan=$(ls /usr/lib/x86_64-linux-gnu/libasan.so.* /usr/lib64/libasan.so.* 2>/dev/null | head -n 1 || true)
libstdcxx=$(ls /usr/lib/x86_64-linux-gnu/libstdc++.so.6 2>/dev/null | head -n 1)
[ -n "$libasan" ] || { echo "no libasan found" >&2; exit 2; }
LD_PRELOAD="$libasan $libstdcxx" PYTHONMALLOC=malloc \
ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:log_path=$ASAN_DIR/asan.log:allow_user_segv_handler=1:detect_odr_violation=0" \
PYTHONPATH="$PWD" FQNCKPT_CRASH_DIR="$ASAN_DIR" exec python tests/repro/spawn_loop.py "$world" "$runs"
