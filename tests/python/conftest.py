"""Puts the built kda package on sys.path (kda_paths) and this folder, for the shared helpers."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # kda_paths, kda_reference

import kda_paths  # noqa: E402,F401  (sets sys.path up for `import kda`)
