try:  # Ctrl-C while Python loads clustersim: one line and 130, as cli.main says it later
    import gc
    import signal

    from .errors import raise_terminated

    # SIGTERM (kill, timeout, Slurm) as Ctrl-C, from the start (cli.main)
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, raise_terminated)

    # One command is one short-lived process: no cyclic garbage collection, from the imports on
    # (they and the step make hundreds of thousands of long-lived objects that the collector
    # would rescan again and again; reference counting still frees what is dropped). See
    # api.no_cyclic_gc, which does the same for the simulation when clustersim is a library.
    gc.disable()

    from .cli import main
except KeyboardInterrupt as exc:
    import os
    import sys

    term = type(exc).__name__ == "Terminated"  # (clustersim.errors: SIGTERM)
    sys.stderr.write(f"{'terminated' if term else 'interrupted'}: no outputs written\n")
    sys.stderr.flush()
    os._exit(143 if term else 130)

# the command is the whole process: it ends in main, by os._exit, leaving what the step made
# to the operating system (cli.main, fast_exit)
main(fast_exit=True)
