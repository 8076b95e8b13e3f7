"""kda.QuantLinear: the weight-only int8 / int4 projection from Python. Its W is exactly the scheme's
(NumPy's quantization of the same weight); its output is the scheme computed in float64 within a bound
set from the measured error, on the decode kernels (int16 activations) and the prefill path (fp32
activations); bf16 in and out; x read in place or gathered alike; bad inputs are errors that change
nothing."""

import threading

import kda_paths  # noqa: F401  (puts the built package on sys.path)
import numpy as np
import pytest

import kda
from kda_reference import bf16_round, quantized_activations, quantized_weights, rel_l2

IN, OUT = 256, 320
DECODE_ROWS = (1, 7, 64)  # the integer kernels
PREFILL_ROWS = (65, 200)  # the dequantized tiles through an fp32 matmul

# Bounds: about 3x the rel L2 error reached (printed by each test) on an AVX-512 host.
# The decode kernels against the scheme with x quantized as they quantize it: fp32 rounding only.
KERNEL_BOUND = {"int8": 1.5e-7, "int4": 2.2e-7}
# The prefill path (fp32 activations) against the scheme in float64.
PREFILL_BOUND = 8e-7
# The decode kernels against the scheme in float64 with x unquantized: the int16 activation rounding.
INT16_BOUND = {"int8": 8e-5, "int4": 6.5e-5}


@pytest.fixture(scope="module")
def weight():
    return (np.random.default_rng(1).standard_normal((OUT, IN)) * 0.05).astype(np.float32)


def x_rows(m, seed=2):
    return np.random.default_rng(seed + m).standard_normal((m, IN)).astype(np.float32)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_weights_are_the_scheme(weight, weights):
    q = kda.QuantLinear(weight, weights)
    assert (q.in_features, q.out_features, q.weights, q.precision) == (IN, OUT, weights, "fp32")
    assert np.array_equal(q.dequantized(), quantized_weights(weight, weights))
    packed = IN * OUT * (1 if weights == "int8" else 0.5)
    scales = 4 * OUT * (1 if weights == "int8" else IN // 32)
    assert q.weight_bytes == packed + scales
    assert f"weights={weights}" in repr(q)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_output_is_the_scheme_in_float64(weight, weights):
    q = kda.QuantLinear(weight, weights)
    w64 = quantized_weights(weight, weights).astype(np.float64)
    assert q.decode_rows == max(DECODE_ROWS)
    for m in DECODE_ROWS + PREFILL_ROWS:
        x = x_rows(m)
        y = q(x)
        assert y.dtype == np.float32 and y.shape == (m, OUT)
        exact = x.astype(np.float64) @ w64.T
        if m in DECODE_ROWS:
            kernel = rel_l2(y, quantized_activations(x, weights) @ w64.T)
            int16 = rel_l2(y, exact)
            print(f"{weights} M={m}: kernel {kernel:.2e}, with int16 activations {int16:.2e}")
            assert kernel <= KERNEL_BOUND[weights]
            assert int16 <= INT16_BOUND[weights]
        else:
            err = rel_l2(y, exact)
            print(f"{weights} M={m}: fp32 activations {err:.2e}")
            assert err <= PREFILL_BOUND
    # Quantized: not the dense projection.
    assert rel_l2(q(x_rows(3)), x_rows(3).astype(np.float64) @ weight.astype(np.float64).T) > 1e-3


@pytest.mark.parametrize("m", [5, 100, 300])
def test_bf16_precision_and_torch(weight, m):
    torch = pytest.importorskip("torch")
    q = kda.QuantLinear(weight, "int8", precision="bf16")
    assert q.precision == "bf16"
    x = x_rows(m)
    xb = bf16_round(x)
    # fp32 x is rounded to bf16 first: the same output as x already bf16.
    y = q(x)
    assert np.array_equal(y, q(xb))
    w64 = quantized_weights(weight, "int8").astype(np.float64)
    # In the bf16 precision the integer kernels take more rows where they run on AMX tiles.
    decode = m <= q.decode_rows
    ref = (quantized_activations(xb, "int8") if decode else xb.astype(np.float64)) @ w64.T
    assert rel_l2(y, ref) <= (KERNEL_BOUND["int8"] if decode else PREFILL_BOUND)
    # torch bf16 in: bf16 out, the fp32 result rounded to nearest even.
    yt = q(torch.from_numpy(xb).to(torch.bfloat16))
    assert yt.dtype == torch.bfloat16 and tuple(yt.shape) == (m, OUT)
    assert np.array_equal(yt.float().numpy(), bf16_round(y))
    # torch fp32 in: torch fp32 out, the same values as NumPy's.
    yf = q(torch.from_numpy(x))
    assert yf.dtype == torch.float32 and np.array_equal(yf.numpy(), y)


def test_strided_rows_in_place_and_gathered(weight):
    q = kda.QuantLinear(weight, "int4")
    for m in (9, 80):
        x = x_rows(m)
        want = q(x)
        wide = np.zeros((m, IN + 40), np.float32)
        wide[:, 8 : 8 + IN] = x
        assert np.array_equal(q(wide[:, 8 : 8 + IN]), want)  # spaced-out rows, read in place
        xt = np.asfortranarray(x)
        assert np.array_equal(q(xt), want)  # column-major: gathered first
    assert q(np.zeros((0, IN), np.float32)).shape == (0, OUT)


def test_threads_share_one_projection(weight):
    q = kda.QuantLinear(weight, "int8")
    xs = [x_rows(m, seed=10) for m in (1, 30, 70, 2)]
    want = [q(x) for x in xs]
    got = [None] * len(xs)

    def work(i):
        for _ in range(5):
            got[i] = q(xs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_bad_inputs(weight):
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="multiple of the group size 32"):
        kda.QuantLinear(weight[:, :40], "int4")
    with pytest.raises(ValueError, match="weights must be 'int8' or 'int4'"):
        kda.QuantLinear(weight, "bf16")
    with pytest.raises(ValueError, match="fp8"):
        kda.QuantLinear(weight, "fp8")
    with pytest.raises(ValueError, match="fp16"):
        kda.QuantLinear(weight, precision="fp16")
    with pytest.raises(ValueError, match="dimensions"):
        kda.QuantLinear(weight[0])
    with pytest.raises(ValueError, match="no features"):
        kda.QuantLinear(np.zeros((0, 32), np.float32))
    with pytest.raises(TypeError, match="float32"):
        kda.QuantLinear(weight.astype(np.float64))
    with pytest.raises(TypeError, match="'weight' is None"):
        kda.QuantLinear(None)

    q = kda.QuantLinear(weight, "int8")
    x = x_rows(4)
    y, w = q(x), q.dequantized()
    for call, exc, msg in [
        (lambda: q(x[:, :100]), ValueError, "takes 256 inputs"),
        (lambda: q(x[0]), ValueError, "dimensions"),
        (lambda: q(x[None]), ValueError, "dimensions"),
        (lambda: q(x.astype(np.float64)), TypeError, "float32"),
        (lambda: q(torch.from_numpy(x).to(torch.bfloat16)), ValueError, "precision is fp32"),
        (lambda: q([[1.0] * IN]), TypeError, "torch.Tensor or a numpy.ndarray"),
    ]:
        with pytest.raises(exc, match=msg):
            call()
    assert np.array_equal(q(x), y) and np.array_equal(q.dequantized(), w)  # the projection as it was
