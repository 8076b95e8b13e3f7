"""KimiDeltaAttention.from_pretrained(..., weights="int8" | "int4"): the projections quantized at load, the
same layer as `kda run --weights` (bit for bit), a fraction of the weight bytes, a clear error for an unknown
format."""

import subprocess

import kda_paths  # noqa: F401  (puts the built package on sys.path)
import numpy as np
import pytest

import kda
from test_component import LAYER, MINI, load_case, run_like_kda_run


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_quantized_layer_equals_kda_run(tmp_path, weights, precision):
    config = kda.KimiLinearConfig.from_pretrained(MINI)
    layer = kda.KimiDeltaAttention.from_pretrained(MINI, LAYER, precision=precision, weights=weights)
    dense = kda.KimiDeltaAttention.from_pretrained(MINI, LAYER, precision=precision)
    assert (layer.weights, dense.weights) == (weights, "bf16")
    assert f"weights={weights}" in repr(layer)
    n = dense.weight_bytes // (4 if precision == "fp32" else 2)  # the projections' weight count
    assert layer.weight_bytes <= n * (1.02 if weights == "int8" else 0.63)
    out_npz = tmp_path / "out.npz"
    cmd = [str(kda_paths.BINARY), "run", "--model", str(MINI), "--layer", str(LAYER)]
    cmd += ["--input", str(MINI / "varlen_initstate.npz"), "--output", str(out_npz)]
    cmd += ["--precision", precision, "--weights", weights, "--decode-tail", "2"]
    subprocess.run(cmd, check=True, capture_output=True)
    out, rec, conv = run_like_kda_run(layer, config, load_case("varlen_initstate"), 2)
    with np.load(out_npz) as ref:
        assert np.array_equal(out, ref["out"])
        assert np.array_equal(rec, ref["recurrent_state"])
        assert np.array_equal(conv, ref["conv_state"])
    # Quantized, not dense: the outputs differ from the dense layer's, by the scheme's error (~1e-2 / 1e-1).
    out_dense, _, _ = run_like_kda_run(dense, config, load_case("varlen_initstate"), 2)
    rel = np.linalg.norm(out - out_dense) / np.linalg.norm(out_dense)
    assert 1e-4 < rel < (0.05 if weights == "int8" else 0.4)


def test_unknown_weights_are_refused():
    with pytest.raises(ValueError, match="weights 'fp8'"):
        kda.KimiDeltaAttention.from_pretrained(MINI, LAYER, weights="fp8")
