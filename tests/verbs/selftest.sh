#!/bin/bash
# Self-test of the SoftRoCE guest; run it inside the VM:
#   python tests/verbs/run_in_vm.py -- bash tests/verbs/selftest.sh
# Checks rxe0 with the rdma-core tools, ibv_rc_pingpong and perftest's ib_write_bw
# (server and client on the same device, out-of-band exchange over TCP on 127.0.0.1),
# then that the host's Python environment (numpy) works in the guest.
set -euo pipefail
DEV=${RDKERAS_IB_DEVICE:-rxe0}
GIDX=${RDKERAS_IB_GID_INDEX:-0}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
step() { printf '\n=== [%s s] %s\n' "$(cut -d' ' -f1 /proc/uptime)" "$*"; }

# Waits until something listens on TCP port $1 (the server side of a test).
wait_listen() {
  for _ in $(seq 1 300); do
    ss -Hltn "sport = :$1" | grep -q . && return 0
    sleep 0.1
  done
  echo "nothing listens on port $1" >&2
  return 1
}

# Runs "$server_cmd" in the background and "$client_cmd" against it; both bounded.
pair() {
  local port=$1 tmo=$2; shift 2
  local server=() client=()
  while [ "$1" != "--" ]; do server+=("$1"); shift; done
  shift
  client=("$@")
  timeout "$tmo" "${server[@]}" > /tmp/server.out 2>&1 &
  local spid=$!
  wait_listen "$port" || { kill "$spid" 2>/dev/null; cat /tmp/server.out; return 1; }
  local crc=0 src=0
  timeout "$tmo" "${client[@]}" > /tmp/client.out 2>&1 || crc=$?
  wait "$spid" || src=$?
  echo "--- server (rc $src)"; cat /tmp/server.out
  echo "--- client (rc $crc)"; cat /tmp/client.out
  [ "$src" = 0 ] && [ "$crc" = 0 ]
}

step "rdma link / ibv_devices"
rdma link show
ibv_devices | tee /tmp/devices.out
grep -qw "$DEV" /tmp/devices.out

step "ibv_devinfo -v -d $DEV"
ibv_devinfo -v -d "$DEV" | tee /tmp/devinfo.out
grep -q 'state:.*PORT_ACTIVE' /tmp/devinfo.out
grep -Eq "GID\[ *$GIDX\]:.*fe80:" /tmp/devinfo.out

step "ibv_rc_pingpong (RC send/recv)"
pair 18515 60 ibv_rc_pingpong -d "$DEV" -g "$GIDX" -n 200 -p 18515 \
  -- ibv_rc_pingpong -d "$DEV" -g "$GIDX" -n 200 -p 18515 127.0.0.1
grep -q 'iters in' /tmp/client.out

step "ib_write_bw (RDMA WRITE bandwidth; TCG: check it runs, not its speed)"
pair 18516 120 ib_write_bw -d "$DEV" -x "$GIDX" -F --report_gbits -s 65536 -n 1000 -p 18516 \
  -- ib_write_bw -d "$DEV" -x "$GIDX" -F --report_gbits -s 65536 -n 1000 -p 18516 127.0.0.1
# The result line: "#bytes #iterations BW peak BW average MsgRate".
BW=$(awk '$1 == 65536 && $2 == 1000' /tmp/client.out)
[ -n "$BW" ] || { echo "no ib_write_bw result line" >&2; exit 1; }
echo "ib_write_bw result: $BW"

step "rxe counters"
for c in /sys/class/infiniband/"$DEV"/ports/1/hw_counters/*; do
  printf '%s=%s ' "${c##*/}" "$(< "$c")"  # builtins only: each exec costs ~0.1 s under TCG
done
echo

step "host Python environment in the guest"
if [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"; else PY=$(command -v python3); fi
"$PY" -c 'import sys, numpy; print(sys.executable, sys.version.split()[0], "numpy", numpy.__version__)'

step "pyverbs (Debian python3-pyverbs, system python)"
if /usr/bin/python3 -c 'import pyverbs' 2>/dev/null; then
  /usr/bin/python3 - "$DEV" <<'EOF'
import sys
from pyverbs.device import Context
with Context(name=sys.argv[1]) as ctx:
    attr = ctx.query_port(1)
    print("pyverbs:", sys.argv[1], "port 1 state", attr.state, "gid0", ctx.query_gid(1, 0))
EOF
else
  echo "pyverbs not installed for /usr/bin/python3; skipped"
fi

step "selftest passed"
