import gc

# One command is one short-lived process: no cyclic garbage collection, from the imports on
# (they and the step make hundreds of thousands of long-lived objects that the collector
# would rescan again and again; reference counting still frees what is dropped). See
# api.no_cyclic_gc, which does the same for the simulation when clustersim is a library.
gc.disable()

from .cli import main  # noqa: E402

# the command is the whole process: it ends in main, by os._exit, leaving what the step made
# to the operating system (cli.main, fast_exit)
main(fast_exit=True)
