"""The `sharpi` console script. Until the command line is parsed, Ctrl-C ends the process the way the
signal does, quietly: importing typer, rich and the engine takes a noticeable moment, and a
KeyboardInterrupt raised inside those imports would print a traceback. (An ignored SIGINT, as in a
background job, stays ignored.) Only the script does this: importing sharpi_cli changes no handler."""
import signal


def main() -> None:
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    from .main import main as run  # restores Python's handler once it starts
    run()
