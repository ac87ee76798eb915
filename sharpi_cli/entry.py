"""The `sharpi` console script. Until the command line is parsed, Ctrl-C ends the process the way the
signal does, quietly: importing typer, rich and the engine takes a noticeable moment, and a
KeyboardInterrupt raised inside those imports would print a traceback. (An ignored SIGINT, as in a
background job, stays ignored.) Only the script does this: importing sharpi_cli changes no handler.

It also sets the OpenMP runtime's spin count before torch loads it (omp_defaults)."""
import os
import signal

# libgomp's default: a thread that reaches a barrier first spins ~300,000 times before it sleeps. Beside another
# process whose OpenMP threads spin too (a torch program, a test suite), the thread it waits for is often not
# running, and each of a decoding step's parallel regions then waits out the spin: a SmolLM2 one-token pass took
# 1.4 s instead of 10 ms, now and then, before the thread governor could see anything; 10,000 spins: ~100 ms,
# 1,000: 10-20 ms. Idle, 1,000 spins measured within this machine's noise (README, Speed: "A busy machine").
OMP_SPINS = "1000"


def omp_defaults(environ) -> None:
    """GOMP_SPINCOUNT=1000 where the user set neither it nor OMP_WAIT_POLICY (read once, when libgomp loads)."""
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        environ["GOMP_SPINCOUNT"] = OMP_SPINS


def main() -> None:
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    omp_defaults(os.environ)
    from .main import main as run  # restores Python's handler once it starts
    run()
