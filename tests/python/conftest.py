"""Puts the built kda package on sys.path (kda_paths) and this folder, for the shared helpers; the fixtures
several test files share (the mini checkpoint's config and its KDA layer in both precisions)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # kda_paths, kda_reference

import kda_paths  # noqa: E402,F401  (sets sys.path up for `import kda`)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def config():
    import kda

    return kda.KimiLinearConfig.from_pretrained(kda_paths.MINI)


@pytest.fixture(scope="session")
def layers():
    import kda

    ckpt = kda.Checkpoint(kda_paths.MINI)  # one mapping shared by both precisions
    return {
        p: kda.KimiDeltaAttention.from_pretrained(kda_paths.MINI, kda_paths.MINI_LAYER, precision=p, checkpoint=ckpt)
        for p in ("fp32", "bf16")
    }
