"""How much of the CPU this benchmark did not get: steal time (the hypervisor running other VMs
on our cores) and other processes' busy time, over a measurement, from /proc/stat.

On the 2-core VMs here steal alone has been seen at 50% for minutes, which halves any figure
measured meanwhile; benchmark rows carry this so a reader can tell a slow kernel from a busy host.
"""
from __future__ import annotations

import os
import resource
import time


def _stat() -> tuple[float, float]:
    """(busy seconds of all CPUs excluding steal, steal seconds) since boot."""
    try:
        v = list(map(int, open("/proc/stat").readline().split()[1:]))
    except (OSError, ValueError):
        return 0.0, 0.0
    hz = os.sysconf("SC_CLK_TCK")
    steal = v[7] if len(v) > 7 else 0
    busy = sum(v[:8]) - v[3] - v[4] - steal  # minus idle, iowait, steal
    return busy / hz, steal / hz


def _own_cpu() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


class Load:
    """Start at construction; `.report()` -> (steal in CPUs, other processes' busy time in CPUs)."""

    def __init__(self):
        self.t0, (self.b0, self.s0), self.o0 = time.time(), _stat(), _own_cpu()

    def report(self) -> tuple[float, float]:
        wall = max(1e-9, time.time() - self.t0)
        busy, steal = _stat()
        others = (busy - self.b0) - (_own_cpu() - self.o0)
        return (steal - self.s0) / wall, max(0.0, others) / wall

    def describe(self) -> str:
        steal, others = self.report()
        return f"steal {steal:.2f} cpus, other processes {others:.2f} cpus"
