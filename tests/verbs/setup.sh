#!/usr/bin/env bash
# Prepares the host for tests/verbs/run_in_vm.py (idempotent; a second run takes ~1 s).
#
#  1. apt-get installs QEMU, busybox, kmod and the rdma-core userspace (incl. the rxe
#     provider and perftest) on the host; the guest sees the host's root filesystem.
#  2. apt-get downloads Debian's current kernel image package (it ships rdma_rxe, which
#     the host kernel lacks), extracts only the kernel and the modules needed (rxe and
#     its dependencies, veth, crc32, virtio/9p/overlay for the shared root) into the
#     cache, runs depmod there, and unpacks the bzImage into an ELF vmlinux (QEMU boots
#     it through the PVH entry, which skips the slow in-guest decompression under TCG).
#
# Never touches /boot or /lib/modules. Cache: $RDKERAS_VERBS_CACHE (default
# /var/cache/rdkeras-verbs), ~70 MB download + ~10 MB extracted.
#
# Options: --refresh  run apt-get update and re-resolve the kernel ABI even when a
#                     kernel is already cached (otherwise the cached one is reused).
set -euo pipefail

CACHE="${RDKERAS_VERBS_CACHE:-/var/cache/rdkeras-verbs}"
REFRESH=0
for a in "$@"; do
  case "$a" in
    --refresh) REFRESH=1 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown option $a" >&2; exit 2 ;;
  esac
done

log() { echo "[verbs-setup] $*" >&2; }
t0=$(date +%s.%N)

if [ "$(id -u)" != 0 ]; then
  log "must run as root (apt-get)"; exit 1
fi

PKGS=(qemu-system-x86 busybox-static cpio kmod xz-utils iproute2
      ibverbs-utils ibverbs-providers libibverbs1 rdma-core perftest python3-pyverbs)

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

have_kernel() { [ -f "$CACHE/current" ] && [ -f "$CACHE/kernel/$(cat "$CACHE/current")/.complete" ]; }

APT_UPDATED=0
apt_update_once() {
  if [ "$APT_UPDATED" = 0 ]; then
    log "apt-get update"
    apt-get update -qq
    APT_UPDATED=1
  fi
}

export DEBIAN_FRONTEND=noninteractive
if [ "${#missing[@]}" -gt 0 ]; then
  apt_update_once
  log "installing: ${missing[*]}"
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

mkdir -p "$CACHE/debs" "$CACHE/kernel"

if have_kernel && [ "$REFRESH" = 0 ]; then
  KVER=$(cat "$CACHE/current")
  log "kernel $KVER already cached in $CACHE/kernel/$KVER"
else
  [ "$REFRESH" = 1 ] && apt_update_once
  # linux-image-amd64 is the meta package; its dependency names the current ABI.
  PKG=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
  if [ -z "$PKG" ]; then
    apt_update_once
    PKG=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
  fi
  [ -n "$PKG" ] || { log "cannot resolve the kernel package from linux-image-amd64"; exit 1; }
  KVER=${PKG#linux-image-}
  KDIR="$CACHE/kernel/$KVER"
  if [ -f "$KDIR/.complete" ]; then
    log "kernel $KVER already cached"
  else
    DEB=$(ls "$CACHE/debs/${PKG}_"*.deb 2>/dev/null | head -n1 || true)
    if [ -z "$DEB" ]; then
      log "downloading $PKG"
      # apt's sandbox user cannot write into root's cache: download in a temp dir it owns.
      tmpd=$(mktemp -d)
      chmod 777 "$tmpd"
      (cd "$tmpd" && apt-get download -q "$PKG" >/dev/null 2>&1) || { apt_update_once; (cd "$tmpd" && apt-get download -q "$PKG" >/dev/null); }
      mv "$tmpd"/*.deb "$CACHE/debs/"
      rmdir "$tmpd"
      DEB=$(ls "$CACHE/debs/${PKG}_"*.deb | head -n1)
    fi
    log "extracting kernel and modules from $(basename "$DEB")"
    rm -rf "$KDIR.tmp"
    mkdir -p "$KDIR.tmp"
    LIST="$KDIR.tmp/.contents"
    dpkg-deb --fsys-tarfile "$DEB" | tar -t > "$LIST"
    MODBASE="./lib/modules/$KVER"
    # Path of module $1 in the package ('-' and '_' are interchangeable in module names).
    modpath() { grep -E "^$MODBASE/kernel/(.*/)?${1//[-_]/[-_]}\.ko(\.xz|\.zst)?\$" "$LIST" | head -n1 || true; }
    # Seeds; their dependencies are added below from each module's modinfo.
    SEEDS=(rdma_rxe ib_core ib_uverbs veth udp_tunnel ip6_udp_tunnel
           crc32_generic crc32-pclmul
           virtio_pci virtio_pci_modern_dev virtio_pci_legacy_dev virtio_ring virtio
           9pnet 9pnet_virtio 9p netfs fscache overlay)
    want=()
    for m in "${SEEDS[@]}"; do
      path=$(modpath "$m")
      [ -n "$path" ] || { log "module $m not found in $PKG"; exit 1; }
      want+=("$path")
    done
    files=("./boot/vmlinuz-$KVER" "./boot/config-$KVER" "$MODBASE/modules.builtin" "$MODBASE/modules.builtin.modinfo" "$MODBASE/modules.order")
    done_list=" "
    while [ "${#want[@]}" -gt 0 ]; do
      dpkg-deb --fsys-tarfile "$DEB" | tar -x -C "$KDIR.tmp" "${want[@]}"
      next=()
      for p in "${want[@]}"; do
        done_list+="$p "
        for d in $(modinfo -F depends "$KDIR.tmp/$p" | tr ',' ' '); do
          dp=$(modpath "$d")
          [ -n "$dp" ] || { log "dependency $d of $p not found"; exit 1; }
          case "$done_list ${next[*]:-} " in *" $dp "*) ;; *) next+=("$dp") ;; esac
        done
      done
      want=("${next[@]+"${next[@]}"}")
    done
    dpkg-deb --fsys-tarfile "$DEB" | tar -x -C "$KDIR.tmp" "${files[@]}"
    mv "$KDIR.tmp/boot/vmlinuz-$KVER" "$KDIR.tmp/vmlinuz"
    mv "$KDIR.tmp/boot/config-$KVER" "$KDIR.tmp/config"
    rmdir "$KDIR.tmp/boot"
    rm -f "$LIST"
    depmod -b "$KDIR.tmp" "$KVER"
    # Check that every module we need resolves with its dependencies.
    for m in rdma_rxe ib_uverbs veth crc32_generic 9pnet_virtio 9p overlay virtio_pci; do
      modprobe -d "$KDIR.tmp" -S "$KVER" --show-depends "$m" >/dev/null
    done
    # Unpack the XZ payload of the bzImage into an ELF vmlinux for QEMU's PVH entry.
    python3 - "$KDIR.tmp/vmlinuz" "$KDIR.tmp/vmlinux" <<'EOF'
import lzma, sys
data = open(sys.argv[1], "rb").read()
off = data.find(b"\xfd7zXZ\x00")
if off < 0:
    sys.exit("no XZ payload in bzImage; run_in_vm.py will boot vmlinuz")
elf = lzma.LZMADecompressor().decompress(data[off:])
if elf[:4] != b"\x7fELF":
    sys.exit("payload is not an ELF image")
open(sys.argv[2], "wb").write(elf)
EOF
    touch "$KDIR.tmp/.complete"
    rm -rf "$KDIR"
    mv "$KDIR.tmp" "$KDIR"
  fi
  echo "$KVER" > "$CACHE/current.tmp"
  mv "$CACHE/current.tmp" "$CACHE/current"
  # Keep only the deb of the current kernel.
  find "$CACHE/debs" -name 'linux-image-*.deb' ! -name "linux-image-${KVER}_*" -delete
fi

t1=$(date +%s.%N)
log "ready: kernel $(cat "$CACHE/current") in $CACHE ($(du -sh "$CACHE" | cut -f1)); took $(python3 -c "print(f'{$t1-$t0:.1f}')") s"
