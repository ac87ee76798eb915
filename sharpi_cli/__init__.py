"""The `sharpi` command line (sharpi_cli.main). Until main() starts, Ctrl-C ends the process the way a
signal does, quietly: importing typer, rich and the engine takes a noticeable moment, and a
KeyboardInterrupt raised inside those imports would print a traceback. An ignored SIGINT (a
background job, nohup) stays ignored."""
import signal

if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
