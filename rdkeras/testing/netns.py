"""Several "hosts" on one machine: network namespaces on one switch (tests and benchmarks).

    from rdkeras.testing import netns

    why = netns.why_not()                 # None where namespaces can be made (root, iproute2)
    with netns.hosts(2, rate="1gbit", delay="100us") as (a, b):
        subprocess.run(a.command(["python", "-m", "rdkeras.launch", ...]))
        a.addr, b.addr                    # each host's address on the link

Each host is a namespace with ``lo`` and one end of a veth pair whose other end
is a port of a bridge in a namespace of its own (the switch); addresses come
from a private /24 chosen per process. ``rate`` (a ``tc tbf`` limit) and
``delay`` (``tc netem``) shape both ends of every host's link, as a NIC of that
speed would in both directions. Processes in the namespaces share the file
system and ``boot_id`` but not abstract unix sockets, as containers on one
machine do. Everything is removed on the way out, also when the body raises;
:func:`cleanup_stale` removes what a killed run left behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

PREFIX = "rdk"  # every namespace and link this module makes starts with it


class NetnsError(RuntimeError):
    """A namespace, link or shaping step failed; the message holds the command and its error."""


@dataclass(frozen=True)
class Host:
    name: str  # the namespace
    addr: str  # its address on the veth link
    device: str  # its end of the veth pair

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.name, *argv]


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def why_not() -> str | None:
    """Why two namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip"):
        return "iproute2's ip command is not installed (apt-get install iproute2)"
    probe = f"{PREFIX}probe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except NetnsError as e:
        return f"cannot create a network namespace: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def _tag() -> str:
    """What begins the names of the namespaces and links this process makes."""
    return f"{PREFIX}{os.getpid()}x"


def names() -> list[str]:
    """Every network namespace on the machine, by name."""
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def left_by_this_process() -> list[str]:
    """The namespaces :func:`hosts` made in this process that still exist (none once every `hosts()` block is
    left); another job's namespaces, made beside this one, are not looked at."""
    return [name for name in names() if name.startswith(_tag())]


def cleanup_stale() -> list[str]:
    """Deletes namespaces this module made in processes that no longer run; returns their names."""
    removed = []
    for name in names():
        pid = name[len(PREFIX) :].split("x")[0]
        if name.startswith(PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            removed.append(name)
    return removed


MAX_HOSTS = 4


def _shape(namespace: str, device: str, rate: str | None, delay: str | None) -> None:
    try:
        _add_qdiscs(namespace, device, rate, delay)
    except NetnsError as e:
        what = "tc netem (delay) needs the kernel's sch_netem" if delay else "tc tbf (rate) needs sch_tbf"
        raise NetnsError(f"cannot shape {device}: {what}: {e}") from None


def _add_qdiscs(namespace: str, device: str, rate: str | None, delay: str | None) -> None:
    tc = ["netns", "exec", namespace, "tc", "qdisc", "add", "dev", device]
    if rate and delay:
        _ip(*tc, "root", "handle", "1:", "netem", "delay", delay)
        _ip(*tc, "parent", "1:", "handle", "2:", "tbf", "rate", rate, "burst", "256kb", "latency", "10ms")
    elif rate:
        _ip(*tc, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "10ms")
    elif delay:
        _ip(*tc, "root", "netem", "delay", delay)


@contextlib.contextmanager
def hosts(count: int = 2, *, rate: str | None = None, delay: str | None = None) -> Iterator[list[Host]]:
    """`count` namespaces, each linked to one switch, removed on the way out.

    Args:
        count: Hosts to make, 2 to 4.
        rate: Bandwidth cap on each end of every host's link, in tc's units ("1gbit", "100mbit"); None: unshaped.
        delay: Added one-way latency on each end ("100us", "1ms"); None: none.
    """
    if not 2 <= count <= MAX_HOSTS:
        raise ValueError(f"hosts(count) makes 2 to {MAX_HOSTS} hosts, not {count}")
    why = why_not()
    if why:
        raise NetnsError(why)
    tag = f"{_tag()[len(PREFIX) :]}{os.urandom(2).hex()}"
    subnet = f"10.{200 + os.getpid() % 50}.{int.from_bytes(os.urandom(1), 'big')}"
    switch = f"{PREFIX}{tag}sw"
    made = [Host(f"{PREFIX}{tag}{side}", f"{subnet}.{i + 1}", f"{PREFIX}{tag[-4:]}{side}") for i, side in
            enumerate("abcd"[:count])]  # fmt: skip
    try:
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for h in made:
            port = f"{h.device}s"  # the switch's end
            _ip("netns", "add", h.name)
            _ip("link", "add", h.device, "type", "veth", "peer", "name", port)
            _ip("link", "set", h.device, "netns", h.name)
            _ip("link", "set", port, "netns", switch)
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            _ip("netns", "exec", h.name, "ip", "addr", "add", f"{h.addr}/24", "dev", h.device)
            _ip("netns", "exec", h.name, "ip", "link", "set", h.device, "up")
            _ip("netns", "exec", h.name, "ip", "link", "set", "lo", "up")
            _shape(h.name, h.device, rate, delay)
            _shape(switch, port, rate, delay)
        yield made
    finally:
        # The links first (a namespace is freed lazily, and its veth end with it), wherever each end is now.
        for h in made:
            for argv in (["ip", "-n", h.name, "link", "del", h.device], ["ip", "link", "del", h.device]):
                subprocess.run(argv, capture_output=True, timeout=30)
        for name in [h.name for h in made] + [switch]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
