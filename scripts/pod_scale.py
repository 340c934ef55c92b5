"""``python scripts/pod_scale.py`` is ``python benchmarks/pod_scale.py``: the command the README and the targets of
every issue name. The developers' benchmarks live in benchmarks/, apart from what users run."""

import os
import runpy
import sys

if __name__ == "__main__":
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "pod_scale.py")
    sys.path.insert(0, os.path.dirname(script))
    sys.argv[0] = script
    runpy.run_path(script, run_name="__main__")
