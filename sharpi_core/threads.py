"""How many threads the CPU kernels use when the user leaves -t to sharpi.

Every kernel call splits its work over all threads and waits for the last one. When another process
keeps a core busy, one of our threads is often waiting for a CPU, and every call waits with it: on
this 2-core machine one busy background process takes SmolLM2 decoding from 4.1 to 14.7 ms a token
with 2 threads, while 1 thread runs at 4.9 ms (llama.cpp loses the same way: 203 -> 77 t/s).

Linux counts the time each of our threads spent runnable but waiting for a CPU (/proc/self/task/
*/schedstat: per process, so right in a container too). `ThreadGovernor.step()`, called once per
decoding step and per prompt batch, reads it every `window` seconds: when our threads waited for
more than `high` of their time, it takes one thread away; now and then it gives one back to see
whether the cores are free again (a failed try doubles the time to the next, up to a minute). The results do not depend on the thread count (each output of a kernel is
computed by one thread in a fixed order), only the speed does. Where torch multiplies a weight instead (no
compiled kernels, SHARPI_CPU_KERNEL=0 or SHARPI_ACT_QUANT=0) they do, for some prompt passes: there the count
stays as set. SHARPI_THREADS_ADAPT=0 turns it off.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from .switches import switch

ENABLED = switch("SHARPI_THREADS_ADAPT")


def process_cores() -> int:
    """The cores this process may run on (its affinity mask: taskset, a container's cpuset), else the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run_delay_ns() -> int | None:
    """Nanoseconds the threads of this process have spent waiting for a CPU (None where unknown)."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total


class ThreadGovernor:
    def __init__(self, max_threads: int, *, window: float = 0.3, high: float = 0.15, probe: float = 4.0,
                 probe_max: float = 60.0, clock: Callable[[], float] = time.perf_counter,
                 delay: Callable[[], int | None] = run_delay_ns,
                 set_threads: Callable[[int], None] = torch.set_num_threads):
        self.max, self.n = max_threads, max_threads
        self.window, self.high, self.probe0, self.probe_max = window, high, probe, probe_max
        self.clock, self.delay, self.set_threads = clock, delay, set_threads
        self.probe = probe
        self.t0 = clock()
        self.d0 = delay()
        self.last_change = self.t0
        self.probing = False   # the last change gave a thread back: a failure doubles the wait
        self.changes = 0

    @classmethod
    def for_this_process(cls) -> "ThreadGovernor | None":
        """A governor over torch's current thread count, or None (disabled, one thread, no schedstat, or a weight
        loaded so far multiplied by torch, whose bits may change with the count: quants.thread_count_changes_bits)."""
        from .quants import thread_count_changes_bits
        n = torch.get_num_threads()
        if not ENABLED or n < 2 or run_delay_ns() is None or thread_count_changes_bits():
            return None
        return cls(n)

    def _use(self, n: int, now: float) -> None:
        self.n = n
        self.set_threads(n)
        self.last_change = now
        self.changes += 1

    def step(self) -> None:
        now = self.clock()
        if now - self.t0 < self.window:
            return
        d = self.delay()
        if d is None or self.d0 is None:
            self.t0, self.d0 = now, d
            return
        waited = (d - self.d0) / 1e9 / ((now - self.t0) * self.n)  # per thread, a fraction of the window
        self.t0, self.d0 = now, d
        if waited > self.high and self.n > 1:
            if self.probing:  # the thread given back was kept waiting: wait longer before the next try
                self.probe = min(self.probe * 2, self.probe_max)
            self.probing = False
            self._use(self.n - 1, now)
            return
        if self.probing:  # the thread given back ran without waiting
            self.probing, self.probe = False, self.probe0
        if self.n < self.max and now - self.last_change >= self.probe:
            self.probing = True
            self._use(self.n + 1, now)


@contextmanager
def using_threads(n: int | None) -> Iterator[None]:
    """torch's thread count, which the CPU kernels read at each call, set to n inside the block and put
    back after it (None: left as it is): a draft model's own -td / -tbd."""
    was = torch.get_num_threads()
    if n is None or n == was:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(was)
