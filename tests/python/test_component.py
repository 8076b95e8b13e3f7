"""The Python serving component (kda.KimiDeltaAttention, MemoryPools, ForwardBatch, KDAAttnBackend):
bit for bit against `kda run` on the vendored dumps, the pools and their zero-copy views, errors that
change nothing, prefill + decode against one EXTEND, and torch bf16 input."""

import gc
import subprocess

import kda_paths  # noqa: F401  (puts the built package on sys.path)
import numpy as np
import pytest

import kda

MINI = kda_paths.MINI
LAYER = kda_paths.MINI_LAYER


def load_case(name):
    with np.load(MINI / f"{name}.npz") as z:
        c = {k: z[k] for k in z.files}
    T = c["hidden_states"].shape[0]
    c.setdefault("cu_seqlens", np.array([0, T], np.int32))
    return c


def make_pools(config, size, precision, max_requests=None):
    pc = kda.RecurrentStatePoolConfig.from_config(config, size, precision, layer_ids=[LAYER])
    return kda.MemoryPools(pc, max_requests or size)


def run_like_kda_run(layer, config, case, decode_tail):
    """runtime/layer_runner.cc's run_layer_case from Python: one EXTEND of each sequence's first T_i - k_i
    tokens, then DECODE steps of the last k_i."""
    x, cu = case["hidden_states"], case["cu_seqlens"].astype(np.int64)
    N = len(cu) - 1
    pools = make_pools(config, max(N, 1), layer.precision)
    reqs = pools.req_to_token_pool.alloc(N)
    slots = pools.req_to_token_pool.get_recurrent_indices(reqs)
    has_init = "initial_recurrent_state" in case or "initial_conv_state" in case
    if has_init:
        pools.recurrent_state_pool.set_linear_recurrent_layer_cache(
            LAYER, slots, case.get("initial_recurrent_state"), case.get("initial_conv_state")
        )
    backend = kda.KDAAttnBackend()
    out = np.zeros_like(x)
    seq = np.diff(cu)
    tail = np.minimum(decode_tail, seq)
    ext = seq - tail
    fb = kda.ForwardBatch.extend(reqs, ext.tolist(), [1 if has_init else 0] * N)
    backend.init_forward_metadata(fb, slots)
    rows = np.concatenate([np.arange(cu[i], cu[i] + ext[i]) for i in range(N)])
    out[rows] = layer(np.ascontiguousarray(x[rows]), fb, pools)
    for j in range(int(tail.max()) if N else 0):
        active = [i for i in range(N) if tail[i] > j]
        fb = kda.ForwardBatch.decode([reqs[i] for i in active])
        backend.init_forward_metadata(fb, [slots[i] for i in active])
        rows = np.array([cu[i] + ext[i] + j for i in active])
        out[rows] = layer(np.ascontiguousarray(x[rows]), fb, pools)
    rec, conv = pools.recurrent_state_pool.read_linear_recurrent_layer_cache(LAYER, slots)
    return out, rec, conv


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "case,decode_tail",
    [("varlen_initstate", 0), ("varlen_initstate", 3), ("unbalanced_5_17_1_41", 2), ("T65", 0)],
)
def test_equals_kda_run_bit_for_bit(layers, config, tmp_path, case, decode_tail, precision):
    assert kda_paths.BINARY.exists(), f"no kda binary at {kda_paths.BINARY} (build it, or set KDA_BINARY)"
    out_npz = tmp_path / "out.npz"
    cmd = [str(kda_paths.BINARY), "run", "--model", str(MINI), "--layer", str(LAYER)]
    cmd += ["--input", str(MINI / f"{case}.npz"), "--output", str(out_npz)]
    cmd += ["--precision", precision, "--decode-tail", str(decode_tail)]
    subprocess.run(cmd, check=True, capture_output=True)
    with np.load(out_npz) as ref:
        out, rec, conv = run_like_kda_run(layers[precision], config, load_case(case), decode_tail)
        assert out.dtype == np.float32
        assert np.array_equal(out, ref["out"])
        assert np.array_equal(rec, ref["recurrent_state"])
        assert np.array_equal(conv, ref["conv_state"])


def test_config_and_layer(config, layers):
    assert config.hidden_size == 256 and config.num_heads == 4 and config.head_dim == 128
    assert config.kda_layer_ids() == [0] and config.is_kda_layer(0)
    assert "hidden_size=256" in repr(config)
    layer = layers["bf16"]
    assert (layer.layer_id, layer.precision, layer.hidden_size) == (0, "bf16", 256)
    assert "bf16" in repr(layer)
    with pytest.raises(ValueError, match="precision"):
        kda.KimiDeltaAttention.from_pretrained(MINI, 0, precision="fp16")
    with pytest.raises((ValueError, RuntimeError), match="layer"):
        kda.KimiDeltaAttention.from_pretrained(MINI, 3)


def fresh_request(config, precision="fp32", size=4):
    pools = make_pools(config, size, precision)
    return pools, pools.req_to_token_pool.alloc(1)[0]


def test_pools_alloc_free_copy_slot_and_views(config, layers):
    layer = layers["fp32"]
    pools = make_pools(config, 3, "fp32")
    pool, reqs = pools.recurrent_state_pool, pools.req_to_token_pool
    rec, conv = pool.recurrent_state(LAYER), pool.conv_state(LAYER)
    H, K, W, C = config.num_heads, config.head_dim, config.short_conv_kernel_size, 3 * config.projection_size
    assert rec.shape == (4, H, K, K) and rec.dtype == np.float32
    assert conv.shape == (4, W - 1, C) and conv.dtype == np.float32

    a, b = reqs.alloc(2)
    sa, sb = reqs.get_recurrent_indices([a, b])
    assert pool.available == 1 and pool.is_allocated(sa) and pool.is_allocated(sb)
    rng = np.random.default_rng(0)
    r0 = rng.standard_normal((H, K, K), dtype=np.float32) * 0.1
    c0 = rng.standard_normal((W - 1, C), dtype=np.float32)
    # Written through the views into a's slot, through set_linear_recurrent_layer_cache into b's.
    rec[sa], conv[sa] = r0, c0
    pool.set_linear_recurrent_layer_cache(LAYER, [sb], r0[None], c0[None])
    got_r, got_c = pool.read_linear_recurrent_layer_cache(LAYER, [sa])
    assert np.array_equal(got_r[0], r0) and np.array_equal(got_c[0], c0)

    # The next forward reads what the views hold: a decode of the same token from both slots agrees, and
    # the views show the states it wrote.
    x = load_case("T8")["hidden_states"][:1]
    backend = kda.KDAAttnBackend()
    fb = kda.ForwardBatch.decode([a, b])
    backend.init_forward_metadata(fb, pools)
    y = layer(np.concatenate([x, x]), fb, pools)
    assert np.array_equal(y[0], y[1])
    assert np.array_equal(rec[sa], rec[sb]) and not np.array_equal(rec[sa], r0)
    assert np.array_equal(conv[sa], conv[sb]) and np.array_equal(conv[sa, 0], c0[1])  # shifted by a token
    fresh, fresh_req = fresh_request(config)
    fb1 = kda.ForwardBatch.decode([fresh_req])
    backend.init_forward_metadata(fb1, fresh)
    assert not np.array_equal(layer(x, fb1, fresh)[0], y[0])  # the state mattered

    # copy_slot: the copy is visible through the views; fork copies too.
    [c] = reqs.alloc(1)
    sc = reqs.slot_of(c)
    assert not rec[sc].any() and not conv[sc].any()  # cleared on alloc
    pool.copy_slot(sa, sc)
    assert np.array_equal(rec[sc], rec[sa]) and np.array_equal(conv[sc], conv[sa])

    # Exhausted pool / unknown slots: clear errors, nothing changed.
    before = (rec.copy(), conv.copy(), pool.available, reqs.available)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.alloc(1)
    with pytest.raises(RuntimeError, match="exhausted"):
        reqs.alloc(1)
    with pytest.raises(ValueError, match="slot 7 is out of range"):
        pool.copy_slot(sa, 7)
    with pytest.raises(ValueError, match="reserved"):
        pool.free([sa, 0])
    with pytest.raises(ValueError, match="request index 3 is out of range"):
        reqs.free([a, 3])
    with pytest.raises(ValueError, match="layer 5"):
        pool.recurrent_state(5)
    with pytest.raises(ValueError, match="shape"):
        pool.set_linear_recurrent_layer_cache(LAYER, [sa], r0)
    assert pool.is_allocated(sa) and pool.is_allocated(sb) and pool.is_allocated(sc)
    assert (pool.available, reqs.available) == before[2:]
    assert np.array_equal(rec, before[0]) and np.array_equal(conv, before[1])

    reqs.free([b])
    assert not pool.is_allocated(sb) and pool.available == 1
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([sb])
    with pytest.raises(ValueError, match="not allocated"):
        reqs.get_recurrent_indices([b])
    with pytest.raises(ValueError, match="not allocated"):
        reqs.free([b])

    # A view keeps its pool alive.
    view = make_pools(config, 2, "fp32").recurrent_state_pool.recurrent_state(LAYER)
    gc.collect()
    view[1] = 1.0
    assert view.sum() == H * K * K


def test_bf16_conv_view(config, layers):
    torch = pytest.importorskip("torch")
    pools, req = fresh_request(config, "bf16")
    pool = pools.recurrent_state_pool
    slot = pools.req_to_token_pool.slot_of(req)
    x = load_case("T8")["hidden_states"]
    backend = kda.KDAAttnBackend()
    fb = kda.ForwardBatch.extend([req], [8])
    backend.init_forward_metadata(fb, pools)
    layers["bf16"](x, fb, pools)
    bits = pool.conv_state(LAYER)
    assert bits.dtype == np.uint16
    t = pool.conv_state_tensor(LAYER)
    assert t.dtype == torch.bfloat16 and t.data_ptr() == bits.ctypes.data
    _, conv = pool.read_linear_recurrent_layer_cache(LAYER, [slot])
    assert torch.equal(t[slot].float(), torch.from_numpy(conv[0]))
    r = pool.recurrent_state_tensor(LAYER)
    assert r.dtype == torch.float32 and r.data_ptr() == pool.recurrent_state(LAYER).ctypes.data


def test_layer_errors_change_nothing(config, layers):
    layer = layers["fp32"]
    pools = make_pools(config, 2, "fp32")
    pool, reqs = pools.recurrent_state_pool, pools.req_to_token_pool
    a = reqs.alloc(1)[0]
    x = load_case("T8")["hidden_states"]
    backend = kda.KDAAttnBackend()
    fb = kda.ForwardBatch.extend([a], [8])
    backend.init_forward_metadata(fb, pools)
    layer(x, fb, pools)
    rec, conv = pool.recurrent_state(LAYER), pool.conv_state(LAYER)
    before = rec.copy(), conv.copy()

    dec = kda.ForwardBatch.decode([a])
    with pytest.raises(ValueError, match="attn_backend"):
        layer(x[:1], dec, pools)  # no metadata for this batch yet
    with pytest.raises(ValueError, match="request index 1"):
        backend.init_forward_metadata(kda.ForwardBatch.decode([1]), pools)  # request 1 not allocated
    backend.init_forward_metadata(dec, pools)
    with pytest.raises(ValueError, match="rows for a batch of 1"):
        layer(x[:2], dec, pools)
    with pytest.raises(ValueError, match="hidden size"):
        layer(x[:1, :128], dec, pools)
    with pytest.raises(TypeError):
        layer(x[:1].astype(np.float64), dec, pools)
    with pytest.raises(TypeError, match="pools"):
        layer(x[:1], dec, "pools")
    with pytest.raises(ValueError, match="metadata"):
        layer(x[:8], fb, pools)  # the backend holds the decode batch's metadata now
    with pytest.raises(ValueError):
        kda.ForwardBatch.extend([a], [8, 1])
    with pytest.raises(ValueError):
        kda.KDAAttnBackend(kernel="fast")
    other = make_pools(config, 2, "fp32")  # a pool where the batch's slot is not allocated
    with pytest.raises(ValueError, match="not allocated"):
        layer(x[:1], dec, other)
    reqs.free([a])  # the batch's slot freed after its metadata was made
    with pytest.raises(ValueError, match="not allocated"):
        layer(x[:1], dec, pools)
    assert np.array_equal(rec, before[0]) and np.array_equal(conv, before[1])


def within_fp32_tolerance(a, b):
    return np.all(np.abs(a - b) <= 1e-5 + 1e-5 * np.abs(b))


def test_prefill_then_decode_equals_one_extend(config, layers):
    layer = layers["fp32"]
    case = load_case("unbalanced_5_17_1_41")
    x, cu = case["hidden_states"], case["cu_seqlens"]
    # Two requests: sequence 1 (17 tokens) and sequence 3 (41 tokens).
    seqs = [x[cu[1] : cu[2]], x[cu[3] : cu[4]]]
    backend = kda.KDAAttnBackend()

    whole = make_pools(config, 2, "fp32")
    r_whole = whole.req_to_token_pool.alloc(2)
    fb = kda.ForwardBatch.extend(r_whole, [len(s) for s in seqs])
    backend.init_forward_metadata(fb, whole)
    ref = layer(np.concatenate(seqs), fb, whole)
    ref = [ref[: len(seqs[0])], ref[len(seqs[0]) :]]

    pools = make_pools(config, 2, "fp32")
    reqs = pools.req_to_token_pool.alloc(2)
    outs = [[], []]
    # Chunked prefill: 6 then 4 tokens of each, then a decode step per remaining token (a shrinking batch).
    done = 0
    for n in (6, 4):
        fb = kda.ForwardBatch.extend(reqs, [n, n], [done, done])
        backend.init_forward_metadata(fb, pools)
        y = layer(np.concatenate([s[done : done + n] for s in seqs]), fb, pools)
        outs[0].append(y[:n])
        outs[1].append(y[n:])
        done += n
    for t in range(done, len(seqs[1])):
        active = [i for i in range(2) if t < len(seqs[i])]
        fb = kda.ForwardBatch.decode([reqs[i] for i in active])
        backend.init_forward_metadata(fb, pools)
        y = layer(np.stack([seqs[i][t] for i in active]), fb, pools)
        for row, i in enumerate(active):
            outs[i].append(y[row : row + 1])
    for i in range(2):
        assert within_fp32_tolerance(np.concatenate(outs[i]), ref[i])
    slots = pools.req_to_token_pool.get_recurrent_indices(reqs)
    slots_whole = whole.req_to_token_pool.get_recurrent_indices(r_whole)
    for got, want in zip(
        pools.recurrent_state_pool.read_linear_recurrent_layer_cache(LAYER, slots),
        whole.recurrent_state_pool.read_linear_recurrent_layer_cache(LAYER, slots_whole),
    ):
        assert within_fp32_tolerance(got, want)


def test_torch_inputs(config, layers):
    torch = pytest.importorskip("torch")
    x = load_case("T64")["hidden_states"]

    def run(layer, inp, precision):
        pools, req = fresh_request(config, precision)
        backend = kda.KDAAttnBackend()
        fb = kda.ForwardBatch.extend([req], [inp.shape[0]])
        backend.init_forward_metadata(fb, pools)
        return layer(inp, fb, pools)

    xb = torch.from_numpy(x).to(torch.bfloat16)
    x32 = xb.float()  # the same, bf16-representable values as float32
    out_b = run(layers["bf16"], xb, "bf16")
    out_f = run(layers["bf16"], x32, "bf16")
    out_n = run(layers["bf16"], x32.numpy(), "bf16")
    assert out_b.dtype == torch.bfloat16 and out_f.dtype == torch.float32 and isinstance(out_n, np.ndarray)
    assert out_b.shape == (64, config.hidden_size)
    assert torch.equal(out_b.float(), out_f)  # the bf16 layer's output is bf16 values
    assert np.array_equal(out_f.numpy(), out_n)
    # A strided (non-contiguous) input gives the same values.
    wide = torch.zeros(64, 2 * config.hidden_size)
    wide[:, ::2] = x32
    assert torch.equal(run(layers["bf16"], wide[:, ::2], "bf16"), out_f)
    # fp32 layer from torch float32 equals NumPy.
    assert np.array_equal(run(layers["fp32"], torch.from_numpy(x), "fp32").numpy(), run(layers["fp32"], x, "fp32"))


README_EXAMPLE = '''
import numpy as np
import kda

path = "tests/data/kda_dumps/mini"
config = kda.KimiLinearConfig.from_pretrained(path)
layer = kda.KimiDeltaAttention.from_pretrained(path, layer=0, precision="fp32")

# One pool slot per request for every KDA layer of the model; one backend shared by every layer.
pools = kda.MemoryPools.from_config(config, size=8, precision="fp32")
backend = kda.KDAAttnBackend()

x = np.load(f"{path}/T64.npz")["hidden_states"]  # [64, hidden_size] float32
[req] = pools.req_to_token_pool.alloc(1)

# Prefill the first 60 tokens (one EXTEND step) ...
batch = kda.ForwardBatch.extend([req], extend_seq_lens=[60], extend_prefix_lens=[0])
backend.init_forward_metadata(batch, pools)  # once per batch, before the first layer
outs = [layer(x[:60], batch, pools)]
# ... then decode the last 4 tokens, one per step.
for t in range(60, 64):
    batch = kda.ForwardBatch.decode([req])
    backend.init_forward_metadata(batch, pools)
    outs.append(layer(x[t : t + 1], batch, pools))
out = np.concatenate(outs)  # [64, hidden_size]

# The layer's recurrent state, a NumPy view of the pool's buffer (no copy): [N+1, H, K, V]
state = pools.recurrent_state_pool.recurrent_state(layer.layer_id)
print(out.shape, state[pools.req_to_token_pool.slot_of(req)].shape)
pools.req_to_token_pool.free([req])
'''


def test_readme_example(monkeypatch, capsys):
    monkeypatch.chdir(kda_paths.REPO)
    exec(compile(README_EXAMPLE, "README_EXAMPLE", "exec"), {})
    assert capsys.readouterr().out.strip() == "(64, 256) (4, 128, 128)"


def test_threads_share_a_layer(config, layers):
    """The forward runs without the GIL; calls on one layer from several threads take turns and agree."""
    import threading

    layer = layers["fp32"]
    x = load_case("T64")["hidden_states"]

    def run():
        pools, req = fresh_request(config)
        backend = kda.KDAAttnBackend()
        outs = []
        for lo, hi in ((0, 32), (32, 64)):
            fb = kda.ForwardBatch.extend([req], [hi - lo], [lo])
            backend.init_forward_metadata(fb, pools)
            outs.append(layer(x[lo:hi], fb, pools))
        return np.concatenate(outs)

    want = run()
    results = [None] * 4

    def worker(i):
        results[i] = run()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        assert np.array_equal(r, want)


def test_target_verify_then_accept_equals_decode_steps(config, layers):
    """Speculative decoding from Python: a TARGET_VERIFY batch (a chain of 3 drafts and a tree of 3) keeps
    the committed states; accept leaves each slot in the state of DECODE steps over the accepted tokens."""
    layer = layers["fp32"]
    backend = kda.KDAAttnBackend()
    pools = kda.MemoryPools.from_config(config, 4, "fp32", layer_ids=[LAYER], max_verify_tokens=4)
    assert pools.recurrent_state_pool.spec_state_bytes > 0
    D = config.hidden_size
    rng = np.random.default_rng(5)
    prefix = rng.standard_normal((3, D), dtype=np.float32)
    reqs = pools.req_to_token_pool.alloc(4)  # 0, 1 verify; 2, 3 decode the same tokens
    fb = kda.ForwardBatch.extend(reqs, [3] * 4)
    backend.init_forward_metadata(fb, pools)
    layer(np.concatenate([prefix] * 4), fb, pools)
    slots = pools.req_to_token_pool.get_recurrent_indices(reqs)
    before = pools.recurrent_state_pool.read_linear_recurrent_layer_cache(LAYER, slots[:2])

    x = rng.standard_normal((8, D), dtype=np.float32)
    # Row 0: a chain of 3 drafts; row 1: drafts with parents -1, -1, 1 (the last accepted token's two
    # children, then a child of the second).
    fb = kda.ForwardBatch.target_verify(reqs[:2], [3, 3], [-1, 0, 1, -1, -1, 1])
    backend.init_forward_metadata(fb, pools)
    y = layer(x, fb, pools)
    for got, want in zip(pools.recurrent_state_pool.read_linear_recurrent_layer_cache(LAYER, slots[:2]), before):
        assert np.array_equal(got, want)
    with pytest.raises(ValueError, match="accepts position 4 of its 3 drafts"):
        backend.accept(fb, [4, 0], pools)
    backend.accept(fb, [2, 3], pools)  # row 0: 2 drafts; row 1: the path 0 -> draft 1 -> draft 2
    assert not backend.has_pending_verify

    ys = []
    for req, rows in ((reqs[2], [0, 1, 2]), (reqs[3], [4, 6, 7])):
        for r in rows:
            fb = kda.ForwardBatch.decode([req])
            backend.init_forward_metadata(fb, pools)
            ys.append(layer(x[r : r + 1], fb, pools))
    assert within_fp32_tolerance(y[[0, 1, 2, 4, 6, 7]], np.concatenate(ys))
    got = pools.recurrent_state_pool.read_linear_recurrent_layer_cache(LAYER, slots[:2])
    want = pools.recurrent_state_pool.read_linear_recurrent_layer_cache(LAYER, slots[2:])
    for a, b in zip(got, want):
        assert within_fp32_tolerance(a, b)
