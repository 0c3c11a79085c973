"""Run any benchmark command against another xlaserve source tree (A/B of two commits):

    git archive <rev> | tar -x -C /tmp/base
    XLASERVE_BENCH_ROOT=/tmp/base PYTHONPATH=bench/tree_root python -m xlaserve.bench.step_profile ...

With the variable set, Python's start-up imports this file, which points the editable install's
package mapping at that tree (`host_overhead._use_root`, as its `--root`) before anything imports
xlaserve; subprocesses inherit the variable, so staged benchmarks follow. Unset: nothing.
"""

import os

_root = os.environ.get("XLASERVE_BENCH_ROOT")
if _root:
    import importlib.util

    _path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "host_overhead.py"
    )
    _spec = importlib.util.spec_from_file_location("_xlaserve_bench_tree_root", _path)
    _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
    _mod._use_root(os.path.abspath(_root))
