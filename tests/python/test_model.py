"""kda.KimiLinearForCausalLM on the tiny model dumps: logits through the step API (ForwardBatch +
MemoryPools, as the KDA layer is called) within the spec's fp32 tolerance, prefill then DECODE steps equal
to the whole sequence, every state of run_case against the references, bf16 by the spec's rel-L2 rule,
zero-copy outputs (NumPy owning its buffer, torch over the same memory), and bad input that changes
nothing."""

import kda_paths
import numpy as np
import pytest

import kda

TINY = kda_paths.TINY
CASES = ["T1", "T7", "T64", "T65", "T200", "varlen_3", "decode_tail"]


def load_case(name):
    with np.load(TINY / f"{name}.npz") as z:
        c = {k: z[k] for k in z.files}
    T = c["input_ids"].shape[0]
    c.setdefault("cu_seqlens", np.array([0, T], np.int32))
    return c


def max_err_ratio(a, b, tol):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    assert np.all(np.isfinite(a))
    return float(np.max(np.abs(a - b) / (tol + tol * np.abs(b)))) if a.size else 0.0


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def models():
    return {p: kda.KimiLinearForCausalLM.from_pretrained(TINY, precision=p) for p in ("fp32", "bf16")}


def prefill_all(model, case):
    """One EXTEND over every sequence of the case, each a fresh request: logits [T, V]."""
    cu = case["cu_seqlens"].astype(np.int64)
    N = len(cu) - 1
    pools = model.make_pools(max_requests=N, kv_tokens=int(cu[-1]))
    reqs = pools.req_to_token_pool.alloc(N)
    fb = kda.ForwardBatch.extend(reqs, np.diff(cu).tolist())
    return model(case["input_ids"], fb, pools)


@pytest.mark.parametrize("name", CASES)
def test_fp32_logits_within_the_spec_tolerance(models, name):
    case = load_case(name)
    logits = prefill_all(models["fp32"], case)
    assert isinstance(logits, np.ndarray) and logits.dtype == np.float32
    assert logits.flags.owndata and logits.flags.c_contiguous  # owns its buffer, written in place
    assert logits.shape == case["logits"].shape
    assert max_err_ratio(logits, case["logits"], 1e-4) <= 1.0


def test_prefill_then_decode_steps_equal_the_whole_sequence(models):
    model, case = models["fp32"], load_case("decode_tail")
    ids, pre = case["input_ids"], int(case["prefill_len"])
    pools = model.make_pools(max_requests=1, kv_tokens=len(ids))
    (req,) = pools.req_to_token_pool.alloc(1)
    rows = [model(ids[:pre], kda.ForwardBatch.extend([req], [pre]), pools)]
    for t in range(pre, len(ids)):
        fb = kda.ForwardBatch.decode([req])
        rows.append(model(ids[t : t + 1], fb, pools))
    logits = np.concatenate(rows)
    assert max_err_ratio(logits, case["logits"], 1e-4) <= 1.0
    rtp = pools.req_to_token_pool
    assert rtp.seq_len(req) == len(ids)
    assert len(rtp.req_to_token(req)) == len(ids) and rtp.kv_tokens_available == 0
    rtp.free([req])  # the request's MLA token slots go back with it
    assert rtp.kv_tokens_available == len(ids)


@pytest.mark.parametrize("name", ["varlen_3", "decode_tail"])
def test_run_case_states_match_the_references(models, name):
    case = load_case(name)
    tail = len(case["input_ids"]) - int(case["prefill_len"]) if "prefill_len" in case else 1
    out = models["fp32"].run_case(case["input_ids"], case["cu_seqlens"], decode_tail=tail)
    keys = {"logits", "hidden_final", "mla_ckv_3", "mla_kpe_3"}
    keys |= {f"kda_{s}_state_{i}" for s in ("recurrent", "conv") for i in (0, 1, 2)}
    assert set(out) == keys
    for k in keys:
        tol = 1e-4 if k in ("logits", "hidden_final") else 1e-5
        assert max_err_ratio(out[k], case[k], tol) <= 1.0, k


def test_forward_and_compute_logits_split_the_step(models):
    model, case = models["fp32"], load_case("T7")
    pools = model.make_pools(max_requests=1, kv_tokens=7)
    reqs = pools.req_to_token_pool.alloc(1)
    hidden = model.forward(case["input_ids"], kda.ForwardBatch.extend(reqs, [7]), pools)
    assert hidden.shape == case["hidden_final"].shape
    assert max_err_ratio(hidden, case["hidden_final"], 1e-4) <= 1.0
    assert max_err_ratio(model.compute_logits(hidden), case["logits"], 1e-4) <= 1.0


@pytest.mark.parametrize("name", ["T65", "varlen_3"])
def test_bf16_logits_within_twice_the_emulations_error(models, name):
    case = load_case(name)
    logits = prefill_all(models["bf16"], case)
    own = rel_l2(case["logits_bf16"], case["logits"])
    err = rel_l2(logits, case["logits"])
    assert 0.0 < err <= 2.0 * own


def test_torch_input_gives_a_torch_tensor_over_the_same_memory(models):
    torch = pytest.importorskip("torch")
    model, case = models["fp32"], load_case("T7")
    pools = model.make_pools(max_requests=1, kv_tokens=7)
    reqs = pools.req_to_token_pool.alloc(1)
    logits = model(torch.from_numpy(case["input_ids"].astype(np.int64)), kda.ForwardBatch.extend(reqs, [7]), pools)
    assert isinstance(logits, torch.Tensor) and logits.dtype == torch.float32
    assert max_err_ratio(logits.numpy(), case["logits"], 1e-4) <= 1.0


def test_bad_input_is_refused_and_changes_nothing(models):
    model, case = models["fp32"], load_case("T7")
    pools = model.make_pools(max_requests=2, kv_tokens=8)
    reqs = pools.req_to_token_pool.alloc(1)
    bad = case["input_ids"].copy()
    bad[3] = 512  # = vocab_size
    with pytest.raises((ValueError, IndexError), match="512"):
        model(bad, kda.ForwardBatch.extend(reqs, [7]), pools)
    with pytest.raises(TypeError, match="MemoryPools"):
        model(case["input_ids"], kda.ForwardBatch.extend(reqs, [7]), pools.recurrent_state_pool)
    with pytest.raises(TypeError, match="input_ids"):
        model(case["input_ids"].astype(np.float32), kda.ForwardBatch.extend(reqs, [7]), pools)
    # A step larger than the MLA token pool (8 slots): refused before any layer ran.
    more = np.concatenate([case["input_ids"], case["input_ids"]])
    with pytest.raises(RuntimeError, match="MLA KV pool"):
        model(more, kda.ForwardBatch.extend(reqs, [14]), pools)
    # The request is as fresh as before: the same case now gives the reference logits.
    assert pools.req_to_token_pool.seq_len(reqs[0]) == 0 and pools.req_to_token_pool.kv_tokens_available == 8
    logits = model(case["input_ids"], kda.ForwardBatch.extend(reqs, [7]), pools)
    assert max_err_ratio(logits, case["logits"], 1e-4) <= 1.0


def test_from_pretrained_refuses_unknown_options():
    with pytest.raises(ValueError, match="mean"):
        kda.KimiLinearForCausalLM.from_pretrained(TINY, moe_combine="mean")
    with pytest.raises(ValueError, match="fp16"):
        kda.KimiLinearForCausalLM.from_pretrained(TINY, precision="fp16")
