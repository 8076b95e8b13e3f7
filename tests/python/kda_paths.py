"""Where the tests find the package and the binary.

The build's python dir goes on sys.path: $KDA_PYTHONPATH, else <repo>/build/python; KDA_PYTHONPATH=-
tests the kda installed in the interpreter's environment (pip install) instead. The kda binary:
$KDA_BINARY, else <repo>/build/kda.
"""

import os
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
PYTHONPATH = pathlib.Path(os.environ.get("KDA_PYTHONPATH") or REPO / "build" / "python")
BINARY = pathlib.Path(os.environ.get("KDA_BINARY") or REPO / "build" / "kda")
DUMPS = REPO / "tests" / "data" / "kda_dumps"
MINI = DUMPS / "mini"  # a small Kimi-Linear checkpoint with its cases
MINI_LAYER = 0  # its KDA layer
MODEL_DUMPS = REPO / "tests" / "data" / "model_dumps"
TINY = MODEL_DUMPS / "tiny"  # a 4-layer Kimi-Linear in the real pattern (KDA + dense, KDA + MoE, MLA + MoE)

if os.environ.get("KDA_PYTHONPATH") != "-" and str(PYTHONPATH) not in sys.path:
    sys.path.insert(0, str(PYTHONPATH))
