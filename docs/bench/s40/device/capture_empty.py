"""Run a script (argv[1:]) with the graph cache's captures emptying the allocator's caches first,
as torch.cuda.graph does (the engine's captures before `f9255e5`): the "before" of a warm-up A/B.
For the tree it ran on (`f9255e5`'s first form, whose CudaGraphBackend had the switch
`empty_caches_before_capture`); the switch is gone since."""
import os
import runpy
import sys

from strata.engine.graph_cache import CudaGraphBackend

CudaGraphBackend.empty_caches_before_capture = True
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # as `python3 SCRIPT` does
runpy.run_path(sys.argv[0], run_name="__main__")
