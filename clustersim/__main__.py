import gc
import sys

from .cli import main

code = main()
# The process ends here. Python's last garbage collection at exit would walk every object a
# step made (tasks, spans, the cluster graph) only to free them anyway (~0.07 s on the MoE
# step); frozen objects are left to reference counting, which frees them all the same.
gc.freeze()
sys.exit(code)
