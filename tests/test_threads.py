"""The thread governor (sharpi_core/threads.py): its decisions from a scripted clock and run delay."""
from __future__ import annotations

import os

import pytest

from sharpi_core.threads import ThreadGovernor, run_delay_ns


class Machine:
    """A clock and a run-delay counter: `busy` other processes on `cores` cores; our n threads wait
    for a CPU a fraction max(0, n + busy - cores) / (n + busy) of the time."""

    def __init__(self, cores=2, busy=0):
        self.cores, self.busy, self.now, self.delay_ns, self.n = cores, busy, 0.0, 0, None

    def advance(self, dt):
        over = max(0, self.n + self.busy - self.cores) / (self.n + self.busy)
        self.delay_ns += int(dt * self.n * over * 1e9)
        self.now += dt

    def governor(self, n):
        self.n = n
        return ThreadGovernor(n, clock=lambda: self.now, delay=lambda: self.delay_ns,
                              set_threads=lambda k: setattr(self, "n", k))


def run(m, g, seconds, step=0.005):
    seen = []
    for _ in range(int(seconds / step)):
        m.advance(step)
        g.step()
        seen.append(m.n)
    return seen


def test_idle_machine_keeps_every_thread():
    m = Machine(cores=2)
    g = m.governor(2)
    assert set(run(m, g, 30)) == {2} and g.changes == 0


def test_a_busy_core_takes_a_thread_and_failed_probes_back_off():
    m = Machine(cores=2, busy=1)
    g = m.governor(2)
    seen = run(m, g, 60)
    assert seen[-1] == 1 and seen[int(0.35 / 0.005)] == 1  # down after the first window
    # it gives the thread back now and then to look, each failed look doubling the wait (4, 8, 16, 32 s)
    ups = [i for i in range(1, len(seen)) if seen[i] > seen[i - 1]]
    assert 3 <= len(ups) <= 5, ups
    gaps = [b - a for a, b in zip(ups, ups[1:])]
    assert all(b > 1.8 * a for a, b in zip(gaps, gaps[1:])), gaps
    assert sum(n == 2 for n in seen) / len(seen) < 0.05  # little time spent at the slow setting


def test_the_thread_comes_back_when_the_core_frees_up():
    m = Machine(cores=2, busy=1)
    g = m.governor(2)
    run(m, g, 20)
    assert m.n == 1
    m.busy = 0
    seen = run(m, g, 70)  # the next look (within the backed-off wait, at most a minute) succeeds and stays
    assert seen[-1] == 2 and seen.count(1) < len(seen)
    assert set(run(m, g, 30)) == {2}


def test_more_cores_lose_only_the_busy_ones():
    m = Machine(cores=8, busy=2)
    g = m.governor(8)
    run(m, g, 20)
    assert m.n in (6, 7)  # 6 is enough; it looks at 7 now and then


def test_unknown_run_delay_changes_nothing():
    n = []
    clock = iter(range(10**6))
    g = ThreadGovernor(2, clock=lambda: next(clock) * 0.1, delay=lambda: None, set_threads=n.append)
    for _ in range(1000):
        g.step()
    assert not n


def test_run_delay_is_read_on_linux():
    d = run_delay_ns()
    if d is None:
        pytest.skip("no /proc/self/task/*/schedstat here")
    assert isinstance(d, int) and d >= 0


def test_the_console_script_lowers_openmp_spinning_unless_told():
    """The script sets GOMP_SPINCOUNT (libgomp reads it once, as torch loads it) where the user set neither it nor
    OMP_WAIT_POLICY: a thread spinning 300,000 times at each barrier stalled decoding beside another process's
    spinning threads. The process itself gets it: torch's OpenMP runtime, loaded after, reads it."""
    import subprocess
    import sys

    from sharpi_cli.entry import OMP_SPINS, omp_defaults
    for given, want in (({}, {"GOMP_SPINCOUNT": OMP_SPINS}), ({"GOMP_SPINCOUNT": "5"}, {"GOMP_SPINCOUNT": "5"}),
                        ({"OMP_WAIT_POLICY": "active"}, {"OMP_WAIT_POLICY": "active"})):
        env = dict(given)
        omp_defaults(env)
        assert env == want
    code = ("import os, sys; from sharpi_cli import entry; sys.argv = ['sharpi', '--version']; "
            "import atexit; atexit.register(lambda: print(os.environ.get('GOMP_SPINCOUNT'))); entry.main()")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.stdout.split()[-1] == OMP_SPINS, (r.stdout, r.stderr)


@pytest.mark.parametrize("switches", [{}, {"SHARPI_CPU_KERNEL": "0"}, {"SHARPI_ACT_QUANT": "0"}])
def test_no_governor_where_torch_multiplies_a_weight(switches):
    """torch's matmuls may give a prompt pass other bits on another thread count (the compiled kernels never do), so
    where torch multiplies a weight the governor is not made: a busy machine must not change a run's output. Fresh
    processes, since the record is the process's (every weight loaded so far)."""
    import subprocess
    import sys
    if run_delay_ns() is None:
        pytest.skip("no /proc/self/task/*/schedstat here")
    code = ("import numpy as np, torch, gguf; torch.set_num_threads(2)\n"
            "from sharpi_core.quants import QWeight\n"
            "from sharpi_core.threads import ThreadGovernor\n"
            "before = ThreadGovernor.for_this_process() is not None\n"
            "raw = np.zeros((8, 34 * 2), np.uint8)\n"  # an 8 x 64 Q8_0 weight
            "QWeight('w', raw, gguf.GGMLQuantizationType.Q8_0, 8, 64)\n"
            "from sharpi_core.quants import _kernels\n"
            "print(before, ThreadGovernor.for_this_process() is not None, _kernels() is not None)")
    env = {**os.environ, "SHARPI_THREADS_ADAPT": "1", **switches}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    before, after, kernels = (w == "True" for w in r.stdout.split())
    assert before  # nothing loaded yet
    if not switches and not kernels:
        pytest.skip("no compiled kernels on this machine: torch multiplies every weight")
    assert after == (not switches), r.stdout
