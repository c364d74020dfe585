#!/bin/bash
# Stage 2 of the guest started by run_in_vm.py: runs as PID 1 on the host's root
# filesystem (9p, read-only, under a tmpfs overlay). Sets up SoftRoCE on a veth pair,
# runs the job's command, prints the exit-code marker on the serial console, powers off.
# Usage (by stage 1): guest_init.sh JOB_DIR
set -u
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
JOB=$1
NONCE=$(cat "$JOB/nonce")

marker() { printf '\n@@RDKERAS-VM %s nonce=%s@@\n' "$1" "$NONCE"; }
uptime_s() { cut -d' ' -f1 /proc/uptime; }
poweroff_now() {
  sync
  echo o > /proc/sysrq-trigger
  # Wait with a builtin: once the power-off starts, 9p is gone and no program can be run.
  read -r -t 20 <> /run/.hold
  exit 0  # PID 1 exiting panics the kernel; panic=-1 + -no-reboot ends QEMU too.
}
fail() {
  echo "rdkeras-vm: setup failed: $*" >&2
  marker "error"
  poweroff_now
}

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null || true
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=755 tmpfs /run
mkfifo /run/.hold
ln -sf /proc/self/fd /dev/fd 2>/dev/null
echo 1 > /proc/sys/kernel/sysrq
hostname rdkeras-vm

# The kernel's modules (from the cache, visible through the shared root) at the usual place.
KROOT=$(cat "$JOB/kroot")
mkdir -p /lib/modules
mount --bind "$KROOT/lib/modules" /lib/modules || fail "cannot bind $KROOT/lib/modules"

# Extra read-write shares of host directories (run_in_vm.py --rw).
if [ -f "$JOB/rw" ]; then
  i=0
  while IFS= read -r -d '' dir; do
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=none "rw$i" "$dir" \
      || fail "cannot mount rw share $dir"
    i=$((i + 1))
  done < "$JOB/rw"
fi

ip link set lo up

if [ "$(cat "$JOB/rdma")" = 1 ]; then
  # crc32 FIRST: without a crc32 shash rxe cannot init ("failed to init crc32 algorithm")
  # and `rdma link add` fails with "No such file or directory".
  modprobe crc32_generic || fail "modprobe crc32_generic"
  modprobe rdma_rxe || fail "modprobe rdma_rxe"
  modprobe ib_uverbs || fail "modprobe ib_uverbs"
  modprobe veth || fail "modprobe veth"
  # A dedicated veth pair: nothing else touches its addresses. No IPv4 at all; the
  # RoCEv2 GID 0 is the IPv6 link-local one. No DAD, so the address is usable at once.
  ip link add vrx0 type veth peer name vrx1 || fail "ip link add veth"
  for d in vrx0 vrx1; do
    echo 0 > /proc/sys/net/ipv6/conf/$d/accept_dad
    ip link set $d up || fail "ip link set $d up"
  done
  rdma link add rxe0 type rxe netdev vrx0 || fail "rdma link add rxe0"
  gid=/sys/class/infiniband/rxe0/ports/1/gids/0
  for _ in $(seq 1 200); do
    g=$(cat "$gid" 2>/dev/null || true)
    case "$g" in ""|0000:0000:0000:0000:0000:0000:0000:0000) sleep 0.05 ;; *) break ;; esac
  done
  case "$g" in ""|0000:0000:0000:0000:0000:0000:0000:0000) fail "GID 0 of rxe0 stayed empty" ;; esac
  [ -e /dev/infiniband/uverbs0 ] || fail "/dev/infiniband/uverbs0 missing"
  # The device rdkeras's verbs transport is to use (read once by rdkeras.Engine, like any user's setting).
  export RDKERAS_IB_DEVICE=rxe0 RDKERAS_IB_GID_INDEX=0
fi

mapfile -d '' -t ARGV < "$JOB/argv"
mapfile -d '' -t ENVV < "$JOB/env"
CWD=$(cat "$JOB/cwd")
ENVV+=("RDKERAS_IN_VM=1")
[ -n "${RDKERAS_IB_DEVICE:-}" ] && ENVV+=("RDKERAS_IB_DEVICE=$RDKERAS_IB_DEVICE"
  "RDKERAS_IB_GID_INDEX=$RDKERAS_IB_GID_INDEX")

marker "ready uptime=$(uptime_s)"
cd "$CWD" || fail "cannot cd to $CWD"
# Output through a pipe, not the console tty: programs see what they see in CI (no
# colours, no tty line discipline).
env -i "${ENVV[@]}" "${ARGV[@]}" < /dev/null 2>&1 | cat
rc=${PIPESTATUS[0]}
sync
marker "exit code=$rc uptime=$(uptime_s)"
poweroff_now
