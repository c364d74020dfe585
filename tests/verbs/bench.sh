#!/usr/bin/env bash
# In the SoftRoCE guest: perftest's ib_write_bw and rdkeras's send/recv benchmark over
# verbs, side by side on the same rxe0. Under TCG only the ratio means anything.
#   python tests/verbs/run_in_vm.py --timeout 900 -- bash tests/verbs/bench.sh
set -u
cd "$(dirname "$0")/../.."
DEV=${RDKERAS_IB_DEVICE:-rxe0}
GIDX=${RDKERAS_IB_GID_INDEX:-0}
PY=python
[ -x .venv/bin/python ] && PY=.venv/bin/python

echo "== perftest ib_write_bw, 1 MiB messages, on $DEV"
timeout 300 ib_write_bw -d "$DEV" -x "$GIDX" -F --report_gbits -s 1048576 -n 40 -p 18520 > /tmp/ibw-server.out 2>&1 &
server=$!
sleep 2
timeout 300 ib_write_bw -d "$DEV" -x "$GIDX" -F --report_gbits -s 1048576 -n 40 -p 18520 127.0.0.1 | tail -4
wait "$server"

echo "== rdkeras sendrecv, verbs and shm, 1 MB and 4 MB"
exec "$PY" -m rdkeras.bench sendrecv --quick --transports verbs,shm --sizes 1,4 --latency-sizes 8,4096 --out /tmp/rdkeras-bench
