#!/usr/bin/env python3
"""Runs a command inside a small QEMU (TCG) VM with SoftRoCE (rdma_rxe) set up.

    python tests/verbs/run_in_vm.py [--timeout 600] [options] -- COMMAND [ARGS...]

The guest boots Debian's stock kernel (prepared by tests/verbs/setup.sh) and uses the
host's root filesystem, shared read-only over virtio-9p under a tmpfs overlay: every
host path (the repository, the Python interpreter and its packages, rdma-core's
userspace incl. the rxe provider) is visible at the same place, and writes go to guest
memory only (use --rw DIR to share a host directory read-write). In the guest the
device rxe0 sits on a veth pair (vrx0/vrx1) with no IPv4 address; use GID index 0
(IPv6 link-local) and 127.0.0.1/::1 for out-of-band exchange. The command gets the
host's environment (plus RDKERAS_IN_VM=1, RDKERAS_IB_DEVICE=rxe0,
RDKERAS_IB_GID_INDEX=0) and the current directory, and its
stdout/stderr come back through the serial console (merged, on this script's stdout).

Exit status: the guest command's exit status; 124 when the wall-clock timeout ends the
VM; 125 when the VM could not be prepared or booted or the guest setup failed.
No QEMU process outlives this script (it is killed on timeout, on SIGINT/SIGTERM, and
by PR_SET_PDEATHSIG if this script dies).

Stdlib only. Only one VM runs at a time per cache (a lock file); waiting for the lock
counts against --timeout.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import hashlib
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_CACHE = "/var/cache/rdkeras-verbs"
GUEST_INIT = HERE / "guest_init.sh"
BUSYBOX = "/bin/busybox"
# Modules stage 1 needs to mount the shared root (with their dependencies, in order).
STAGE1_MODULES = ["virtio_pci", "9pnet_virtio", "9p", "overlay"]

STAGE1_INIT = r"""#!/bin/busybox sh
# Stage 1 (initramfs, PID 1): mount the host's root over 9p under a tmpfs overlay and
# switch to it; stage 2 (guest_init.sh from the host) does the rest.
/bin/busybox --install -s /bin
export PATH=/bin
mkdir -p /proc /sys /dev /lower /upper /newroot
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
die() {
  echo "rdkeras-vm stage1: $*"
  echo "@@RDKERAS-VM error nonce=$NONCE@@"
  echo o > /proc/sysrq-trigger
  sleep 10
  exit 1
}
for a in $(cat /proc/cmdline); do
  case "$a" in
    rdk_job=*) JOB=${a#rdk_job=} ;;
    rdk_init=*) INIT2=${a#rdk_init=} ;;
    rdk_nonce=*) NONCE=${a#rdk_nonce=} ;;
  esac
done
while read -r m; do
  insmod "/modules/$m" || die "insmod $m failed"
done < /modules/order
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /lower || die "mount 9p failed"
mount -t tmpfs -o mode=755,size=75% tmpfs /upper || die "mount tmpfs failed"
mkdir -p /upper/u /upper/w
mount -t overlay -o lowerdir=/lower,upperdir=/upper/u,workdir=/upper/w overlay /newroot || die "mount overlay failed"
[ -x "/newroot/bin/bash" ] || die "no /bin/bash on the shared root"
[ -f "/newroot$INIT2" ] || die "stage 2 $INIT2 not found on the shared root"
umount /proc /sys /dev
exec switch_root /newroot /bin/bash "$INIT2" "$JOB"
"""


def log(msg: str) -> None:
    print(f"[run_in_vm] {msg}", file=sys.stderr, flush=True)


class Error(Exception):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("RDKERAS_VERBS_CACHE", DEFAULT_CACHE))


def find_kernel(cache: Path) -> tuple[str, Path]:
    cur = cache / "current"
    if not cur.is_file():
        raise Error(f"no cached kernel in {cache}: run `bash {HERE / 'setup.sh'}` first (as root)")
    kver = cur.read_text().strip()
    kdir = cache / "kernel" / kver
    if not (kdir / ".complete").is_file():
        raise Error(f"kernel cache {kdir} incomplete: run `bash {HERE / 'setup.sh'}`")
    return kver, kdir


def cpio_newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A newc cpio archive of (name, mode, data) entries (directories: mode with 0o040000)."""
    out = bytearray()
    ino = 1
    for name, mode, data in [*entries, ("TRAILER!!!", 0, b"")]:
        nlink = 2 if mode & 0o040000 else 1
        fields = [ino, mode, 0, 0, nlink, 0, len(data), 0, 0, 0, 0, len(name) + 1, 0]
        out += b"070701" + b"".join(b"%08X" % f for f in fields)
        out += name.encode() + b"\0"
        out += b"\0" * (-len(out) % 4)
        out += data
        out += b"\0" * (-len(out) % 4)
        ino += 1
    out += b"\0" * (-len(out) % 512)
    return bytes(out)


def stage1_module_paths(kver: str, kdir: Path) -> list[Path]:
    paths: list[Path] = []
    for mod in STAGE1_MODULES:
        res = subprocess.run(
            ["modprobe", "-d", str(kdir), "-S", kver, "--show-depends", mod],
            capture_output=True,
            text=True,
            check=False,
        )
        if res.returncode != 0:
            raise Error(f"modprobe --show-depends {mod} failed: {res.stderr.strip()}")
        for line in res.stdout.splitlines():
            parts = line.split()
            if parts and parts[0] == "insmod":
                p = Path(parts[1])
                if p not in paths:
                    paths.append(p)
            elif parts and parts[0] != "builtin":
                raise Error(f"unexpected modprobe output: {line}")
    return paths


def build_initramfs(cache: Path, kver: str, kdir: Path) -> Path:
    mods = stage1_module_paths(kver, kdir)
    busybox = Path(BUSYBOX).read_bytes()
    h = hashlib.sha256()
    h.update(STAGE1_INIT.encode())
    h.update(busybox)
    for p in mods:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    out = cache / "initramfs" / f"{kver}-{h.hexdigest()[:16]}.cpio"
    if out.is_file():
        return out
    entries: list[tuple[str, int, bytes]] = [
        ("bin", 0o040755, b""),
        ("modules", 0o040755, b""),
        ("init", 0o100755, STAGE1_INIT.encode()),
        ("bin/busybox", 0o100755, busybox),
        ("modules/order", 0o100644, "".join(p.name + "\n" for p in mods).encode()),
    ]
    entries += [(f"modules/{p.name}", 0o100644, p.read_bytes()) for p in mods]
    out.parent.mkdir(parents=True, exist_ok=True)
    for old in out.parent.glob("*.cpio"):
        old.unlink()
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(cpio_newc(entries))
    tmp.rename(out)
    log(f"built {out}")
    return out


def acquire_lock(cache: Path, deadline: float):
    f = open(cache / "vm.lock", "w")
    announced = False
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return f
        except BlockingIOError:
            if not announced:
                log(f"another VM is running (lock {cache / 'vm.lock'}); waiting")
                announced = True
            if time.monotonic() > deadline:
                raise Error("timed out waiting for the VM lock") from None
            time.sleep(0.5)


def remove_stale_jobs() -> None:
    """Removes job folders left by runs that were killed (SIGKILL leaves no time to clean)."""
    for d in Path(tempfile.gettempdir()).glob("rdkeras-vm-*-*"):
        try:
            pid = int(d.name.split("-")[2])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            pass


def set_pdeathsig() -> None:
    """In the QEMU child: die with SIGKILL when this script dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


def main() -> int:
    ap = argparse.ArgumentParser(
        description="Run a command in a QEMU VM with SoftRoCE (rxe0) set up.",
        usage="%(prog)s [options] -- COMMAND [ARGS...]",
    )
    ap.add_argument("--timeout", type=float, default=600, help="wall-clock limit for the whole VM, seconds (600)")
    ap.add_argument(
        "--accel",
        default="tcg,thread=multi",
        help="QEMU -accel value (tcg,thread=multi; KVM does not boot on this kind of host)",
    )
    ap.add_argument("--cpus", type=int, default=2, help="guest vCPUs (2)")
    ap.add_argument("--mem", default="2G", help="guest memory (2G)")
    ap.add_argument(
        "--rw",
        action="append",
        default=[],
        metavar="DIR",
        help="share this host directory read-write at the same path (repeatable)",
    )
    ap.add_argument("--no-rdma", action="store_true", help="skip the rxe/veth setup")
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="extra guest environment")
    ap.add_argument("--verbose", "-v", action="store_true", help="show the kernel's boot messages and QEMU's command")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.command
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        ap.error("no command given (put it after --)")

    t_start = time.monotonic()
    deadline = t_start + args.timeout
    cache = cache_dir()
    qemu_bin = shutil.which("qemu-system-x86_64")
    if not qemu_bin:
        raise Error(f"qemu-system-x86_64 not found: run `bash {HERE / 'setup.sh'}`")
    kver, kdir = find_kernel(cache)
    kernel = kdir / "vmlinux" if (kdir / "vmlinux").is_file() else kdir / "vmlinuz"
    lock = acquire_lock(cache, deadline)  # released when this process exits
    initrd = build_initramfs(cache, kver, kdir)

    rw_dirs = [str(Path(d).resolve()) for d in args.rw]
    for d in rw_dirs:
        if not Path(d).is_dir():
            raise Error(f"--rw {d}: not a directory")
    cwd = os.getcwd()
    for p in [cwd, str(GUEST_INIT), *rw_dirs]:
        if any(c.isspace() for c in p) or "," in p:
            raise Error(f"path with whitespace or comma not supported: {p!r}")

    nonce = secrets.token_hex(8)
    remove_stale_jobs()
    job = Path(tempfile.mkdtemp(prefix=f"rdkeras-vm-{os.getpid()}-"))
    os.chmod(job, 0o755)
    env = dict(os.environ)
    for kv in args.env:
        k, sep, v = kv.partition("=")
        if not sep:
            raise Error(f"--env {kv}: expected K=V")
        env[k] = v
    (job / "nonce").write_text(nonce)
    (job / "kroot").write_text(str(kdir))
    (job / "cwd").write_text(cwd)
    (job / "rdma").write_text("0" if args.no_rdma else "1")
    (job / "argv").write_bytes(b"".join(os.fsencode(a) + b"\0" for a in cmd))
    (job / "env").write_bytes(b"".join(os.fsencode(f"{k}={v}") + b"\0" for k, v in env.items() if "\0" not in v))
    if rw_dirs:
        (job / "rw").write_bytes(b"".join(os.fsencode(d) + b"\0" for d in rw_dirs))

    append = " ".join(
        [
            "console=ttyS0,115200",
            "panic=-1",
            "rdinit=/init",
            "mitigations=off",
            "random.trust_cpu=on",
            "tsc=reliable",
            "i8042.nokbd",
            "i8042.noaux",
            "8250.nr_uarts=1",
            "loglevel=7" if args.verbose else "quiet loglevel=3",
            f"rdk_job={job}",
            f"rdk_init={GUEST_INIT}",
            f"rdk_nonce={nonce}",
        ]
    )
    qemu = [
        qemu_bin,
        "-accel",
        args.accel,
        "-cpu",
        "max",
        "-smp",
        str(args.cpus),
        "-m",
        args.mem,
        "-machine",
        "q35",
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-nic",
        "none",
        "-serial",
        "stdio",
        "-monitor",
        "none",
        "-no-reboot",
        "-kernel",
        str(kernel),
        "-initrd",
        str(initrd),
        "-append",
        append,
        "-fsdev",
        "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap",
        "-device",
        "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
    ]
    for i, d in enumerate(rw_dirs):
        qemu += [
            "-fsdev",
            f"local,id=rw{i},path={d},security_model=none,multidevs=remap",
            "-device",
            f"virtio-9p-pci,fsdev=rw{i},mount_tag=rw{i}",
        ]
    if args.verbose:
        log("qemu: " + shlex.join(qemu))

    proc: subprocess.Popen | None = None
    state = {"ready": None, "exit": None, "error": False, "ready_uptime": None, "exit_uptime": None}
    marker_re = re.compile(rb"^@@RDKERAS-VM (\w+)(.*) nonce=" + nonce.encode() + rb"@@$")
    out = sys.stdout.buffer

    def reader(stream) -> None:
        blank = False  # a held-back empty line: the guest prints one before each marker
        for raw in iter(stream.readline, b""):
            line = raw.rstrip(b"\r\n").replace(b"\r", b"")
            m = marker_re.match(line)
            if blank and not m:
                out.write(b"\n")
            blank = False
            if not line and not m:
                blank = True
                continue
            if m:
                kind, rest = m.group(1).decode(), m.group(2).decode()
                fields = dict(kv.split("=", 1) for kv in rest.split())
                if kind == "ready":
                    state["ready"] = time.monotonic()
                    state["ready_uptime"] = fields.get("uptime")
                elif kind == "exit":
                    state["exit_uptime"] = fields.get("uptime")
                    state["exit"] = int(fields["code"])
                elif kind == "error":
                    state["error"] = True
                continue
            if (state["exit"] is not None or state["error"]) and not args.verbose:
                continue  # the kernel's power-off messages
            out.write(line + b"\n")
            out.flush()

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(signum)

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    timed_out = False
    interrupted = None
    t_boot = time.monotonic()
    try:
        proc = subprocess.Popen(
            qemu,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=set_pdeathsig,
            start_new_session=True,
        )
        th = threading.Thread(target=reader, args=(proc.stdout,), daemon=True)
        th.start()
        while proc.poll() is None:
            if state["exit"] is not None or state["error"]:
                # The guest is powering off; its filesystem is memory only, so don't wait long.
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
    except KeyboardInterrupt as e:
        interrupted = e.args[0] if e.args else signal.SIGINT
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc is not None:
            th.join(timeout=5)
        for s, h in old_handlers.items():
            signal.signal(s, h)
        lock.close()
        shutil.rmtree(job, ignore_errors=True)

    t_end = time.monotonic()
    timing = f"total {t_end - t_start:.1f} s"
    if state["ready"] is not None:
        timing = (
            f"boot to command {state['ready'] - t_boot:.1f} s (guest uptime {state['ready_uptime']} s), "
            f"command {t_end - state['ready']:.1f} s, " + timing
        )
    if interrupted is not None:
        log(f"interrupted by signal {int(interrupted)}; VM killed ({timing})")
        return 128 + int(interrupted)
    if timed_out:
        log(f"TIMEOUT: the VM ran past --timeout {args.timeout:g} s and was killed ({timing})")
        return 124
    if state["error"]:
        log(f"guest setup failed, see the messages above ({timing})")
        return 125
    if state["exit"] is None:
        log(f"the VM stopped without reporting the command's exit code (qemu rc {proc.returncode}; {timing})")
        return 125
    log(f"guest command exited {state['exit']} ({timing})")
    return state["exit"]


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Error as e:
        log(f"error: {e}")
        sys.exit(125)
