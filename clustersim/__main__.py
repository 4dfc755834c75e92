import gc

# One command is one short-lived process: no cyclic garbage collection, from the imports on
# (they and the step make hundreds of thousands of long-lived objects that the collector
# would rescan again and again; reference counting still frees what is dropped). See
# api.no_cyclic_gc, which does the same for the simulation when clustersim is a library.
gc.disable()

import sys  # noqa: E402

from .cli import main  # noqa: E402

code = main()
# Python's last collection at exit would walk every object a step made (tasks, spans, the
# cluster graph) only to free them anyway (~0.07 s on the MoE step); frozen objects are left
# to reference counting, which frees them all the same.
gc.freeze()
sys.exit(code)
