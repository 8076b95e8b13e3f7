"""Puts the built kda package on sys.path: $KDA_PYTHONPATH if set, else <repo>/build/python."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_PKG = os.environ.get("KDA_PYTHONPATH") or os.path.join(_HERE, "..", "..", "build", "python")
sys.path.insert(0, os.path.abspath(_PKG))
sys.path.insert(0, _HERE)  # shared helpers (kda_reference)
