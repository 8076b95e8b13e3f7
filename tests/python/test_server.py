"""`kda serve` through real clients (http.client, curl, the openai SDK) on the tiny checkpoint with a byte
tokenizer, fp32: chat and completions, streamed and not (the chunks concatenate to the whole text), usage,
stop strings, seeds, logprobs against the model's own logits, 32 concurrent clients getting what they get
alone, clients that leave mid-stream or before a whole answer freeing their slots, flat RSS over 1,000
requests, and every bad request answered with its status while the server keeps serving."""

import json
import math
import shutil
import socket
import subprocess
import threading
import time

import numpy as np
import pytest
from server_fixture import Server, make_checkpoint, parse_sse, stream_text

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
CONTEXT = 1024
MAX_BATCH = 40  # request slots: 4 x max batch = 160


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def server(ckpt):
    s = Server(ckpt, "--max-batch", MAX_BATCH, "--context-length", CONTEXT, "--kv-memory", "4MiB")
    yield s
    s.stop()


def chat_body(text, **kw):
    return {"model": "kimi-linear", "messages": [{"role": "user", "content": text}], **kw}


def prompt_ids(k, n):
    """A prompt of n byte ids (< 256), different for each k."""
    rng = np.random.default_rng(1000 + k)
    return [int(x) for x in rng.integers(32, 127, size=n)]


def answer_next(server):
    status, body = server.post(CMPL, {"prompt": "ok", "max_tokens": 2, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] in ("length", "stop")


def test_health_models_and_localhost(server):
    assert server.host == "127.0.0.1"
    status, body = server.request("GET", "/health")
    assert status == 200
    status, body = server.request("GET", "/v1/models")
    assert status == 200 and body["data"][0]["id"] == "kimi-linear"
    assert body["data"][0]["max_model_len"] == CONTEXT
    m = server.metrics()
    assert m["kda_slots_total"] == 4 * MAX_BATCH and m["kda_slots_used"] == 0
    assert "kda_time_to_first_token_seconds_count" in m


def test_metrics_time_a_requests_way_to_the_engine(server):
    # Its preparation (parsing, tokenization) is part of its TTFT: what the server adds to TTFT is measured
    # by taking the engine's part (TTFT less preparation) from what a client sees.
    before = server.metrics()
    answer_next(server)
    after = server.metrics()
    prep = after["kda_request_prepare_seconds_sum"] - before["kda_request_prepare_seconds_sum"]
    ttft = after["kda_time_to_first_token_seconds_sum"] - before["kda_time_to_first_token_seconds_sum"]
    assert after["kda_request_prepare_seconds_count"] == before["kda_request_prepare_seconds_count"] + 1
    assert 0 < prep < ttft
    assert after['kda_request_prepare_seconds_bucket{le="+Inf"}'] == after["kda_request_prepare_seconds_count"]


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read a listening socket's backlog")
def test_listens_with_a_backlog_for_a_burst_of_clients(server):
    # httplib's own backlog of 5 drops the handshakes of a burst of clients connecting at once.
    out = subprocess.run(["ss", "-ltnH", f"sport = :{server.port}"], capture_output=True, text=True, check=True)
    lines = [ln.split() for ln in out.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stdout
    assert int(lines[0][2]) >= 128  # Send-Q of a listening socket: its backlog


@pytest.mark.parametrize("path", [CHAT, CMPL])
def test_stream_concatenates_to_the_whole_text_and_usage_counts(server, path):
    chat = path == CHAT
    body = chat_body("Tell me a story.") if chat else {"prompt": "Once upon a time"}
    body.update(max_tokens=40, temperature=0, return_token_ids=True)
    status, whole = server.post(path, body)
    assert status == 200, whole
    assert whole["object"] == ("chat.completion" if chat else "text_completion")
    choice = whole["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    ids = choice["token_ids"]
    prompt = whole["prompt_token_ids"] if chat else choice["prompt_token_ids"]
    u = whole["usage"]
    assert u["completion_tokens"] == len(ids) and 1 <= len(ids) <= 40
    assert u["prompt_tokens"] == len(prompt) and u["total_tokens"] == len(prompt) + len(ids)
    assert choice["finish_reason"] == ("length" if len(ids) == 40 else "stop")
    if not chat:  # a byte tokenizer: the prompt's ids are its bytes
        assert prompt == list(b"Once upon a time")

    events = server.stream(path, {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == []
    # The same prompt again: the prefix cache restores all of it but its last token; the counts stay.
    su = events[-2]["usage"]
    assert {k: v for k, v in su.items() if k != "prompt_tokens_details"} == {
        k: v for k, v in u.items() if k != "prompt_tokens_details"}
    assert su["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
    streamed, finish = stream_text(events, chat=chat)
    assert streamed == text and finish == choice["finish_reason"]
    if chat:
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    got = [t for e in events[:-1] for c in e["choices"] for t in c.get("token_ids") or []]
    assert got == ids


def test_curl_streams(server):
    if shutil.which("curl") is None:
        pytest.skip("no curl")
    body = chat_body("hello", max_tokens=8, temperature=0)
    out = subprocess.run(
        ["curl", "-sN", f"http://127.0.0.1:{server.port}{CHAT}", "-H", "Content-Type: application/json", "-d",
         json.dumps({**body, "stream": True})],
        capture_output=True, text=True, timeout=60, check=True).stdout
    status, whole = server.post(CHAT, body)
    events = parse_sse(out)
    assert events[-1] == "[DONE]"
    text, finish = stream_text(events)
    assert text == whole["choices"][0]["message"]["content"]
    # Non-streaming through curl too.
    out = subprocess.run(
        ["curl", "-s", f"http://127.0.0.1:{server.port}{CHAT}", "-H", "Content-Type: application/json", "-d",
         json.dumps(chat_body("hello", max_tokens=8, temperature=0, stream=False))],
        capture_output=True, text=True, timeout=60, check=True).stdout
    assert json.loads(out)["choices"][0]["message"]["content"] == text


def test_openai_sdk(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(model="kimi-linear", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=12, temperature=0)
    text = r.choices[0].message.content
    assert r.usage.completion_tokens >= 1 and r.choices[0].finish_reason in ("stop", "length")
    chunks = client.chat.completions.create(model="kimi-linear", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    c = client.completions.create(model="kimi-linear", prompt="abc", max_tokens=10, temperature=0)
    chunks = client.completions.create(model="kimi-linear", prompt="abc", max_tokens=10, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.choices[0].text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="kimi-linear", prompt="abc", max_tokens=10, top_p=1.5)
    assert [m.id for m in client.models.list()] == ["kimi-linear"]


def test_stop_strings(server):
    body = {"prompt": prompt_ids(1, 12), "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    status, whole = server.post(CMPL, body)
    text = whole["choices"][0]["text"]
    assert len(text) >= 20, text
    stop = text[10:13]
    first = text.find(stop)
    status, got = server.post(CMPL, {**body, "stop": [stop, "\x00never"]})
    assert status == 200
    assert got["choices"][0]["text"] == text[:first]
    assert got["choices"][0]["finish_reason"] == "stop"
    events = server.stream(CMPL, {**body, "stop": stop})
    assert stream_text(events, chat=False) == (text[:first], "stop")


def test_seeds_are_reproducible(server):
    body = {"prompt": prompt_ids(2, 10), "max_tokens": 24, "temperature": 1.0, "top_k": 50, "seed": 1234,
            "return_token_ids": True}
    a = server.post(CMPL, body)[1]["choices"][0]["token_ids"]
    b = server.post(CMPL, body)[1]["choices"][0]["token_ids"]
    assert a == b
    events = server.stream(CMPL, {**body, "n": 2})
    per = {0: [], 1: []}
    for e in events[:-1]:
        for c in e["choices"]:
            per[c["index"]] += c.get("token_ids") or []
    assert per[0] == a  # continuation 0 keeps the seed; n = 2 changes nothing for it
    status, r = server.post(CMPL, {**body, "n": 2})
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert [c["token_ids"] for c in r["choices"]] == [per[0], per[1]]
    assert r["usage"]["completion_tokens"] == len(per[0]) + len(per[1])


def test_logprobs_match_the_models_logits(server, ckpt):
    import kda

    body = chat_body("logprobs, please", max_tokens=12, temperature=0, logprobs=True, top_logprobs=5,
                     return_token_ids=True, ignore_eos=True)
    status, r = server.post(CHAT, body)
    assert status == 200, r
    prompt, ids = r["prompt_token_ids"], r["choices"][0]["token_ids"]
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == len(ids) == 12
    for e in content:
        assert len(e["top_logprobs"]) == 5 and sum(math.exp(t["logprob"]) for t in e["top_logprobs"]) <= 1.0 + 1e-5
        assert isinstance(e["bytes"], list)

    model = kda.KimiLinearForCausalLM.from_pretrained(ckpt, precision="fp32")
    seq = np.array(prompt + ids[:-1], np.int32)
    pools = model.make_pools(max_requests=1, kv_tokens=len(seq))
    reqs = pools.req_to_token_pool.alloc(1)
    logits = model(seq, kda.ForwardBatch.extend(reqs, [len(seq)]), pools).astype(np.float64)
    rows = logits[len(prompt) - 1:]
    ref = rows - rows.max(axis=1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(axis=1, keepdims=True))
    for k, tok in enumerate(ids):
        assert tok == int(np.argmax(rows[k]))
        assert abs(content[k]["logprob"] - ref[k, tok]) < 1e-4
        best = np.sort(ref[k])[::-1][:5]
        assert np.allclose([t["logprob"] for t in content[k]["top_logprobs"]], best, atol=1e-4)
    # completions: logprobs N, the chosen token's logprob per position.
    status, c = server.post(CMPL, {"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 2,
                                   "ignore_eos": True, "return_token_ids": True})
    assert c["choices"][0]["token_ids"] == ids
    assert np.allclose(c["choices"][0]["logprobs"]["token_logprobs"], [e["logprob"] for e in content], atol=1e-6)


def client_params(k):
    """32 different requests: greedy and seeded, different prompts, lengths and sampling parameters."""
    rng = np.random.default_rng(100 + k)
    text = "".join(chr(c) for c in rng.integers(97, 123, size=4 + 3 * k))
    p = chat_body(text, max_tokens=6 + k % 11, return_token_ids=True, logprobs=True, top_logprobs=2,
                  ignore_eos=True)
    if k % 2:
        p.update(temperature=0.7 + 0.05 * (k % 5), seed=k, top_p=0.95, top_k=20 + k)
        if k % 4 == 1:
            p.update(repetition_penalty=1.1, presence_penalty=0.3)
    else:
        p.update(temperature=0)
    return p


def tokens_and_gaps(r):
    c = r["choices"][0]
    gaps = [e["top_logprobs"][0]["logprob"] - e["top_logprobs"][1]["logprob"] for e in c["logprobs"]["content"]]
    return c["token_ids"], gaps


def test_32_concurrent_clients_get_what_they_get_alone(server):
    alone = [tokens_and_gaps(server.post(CHAT, client_params(k))[1]) for k in range(32)]
    results = [None] * 32

    def run(k):
        try:
            if k % 3 == 0:
                events = server.stream(CHAT, client_params(k))
                results[k] = [t for e in events[:-1] for c in e["choices"] for t in c.get("token_ids") or []]
            else:
                results[k] = server.post(CHAT, client_params(k))[1]["choices"][0]["token_ids"]
        except Exception as e:  # noqa: BLE001  (reported below)
            results[k] = e

    threads = [threading.Thread(target=run, args=(k,)) for k in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for k in range(32):
        got = results[k]
        assert isinstance(got, list), f"client {k}: {got!r}"
        want, gaps = alone[k]
        if got != want:
            i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            assert gaps[i] < 1e-4, f"client {k} differs at {i} where the top-2 gap is {gaps[i]}"


def wait_idle(server, timeout=30):
    t0 = time.monotonic()
    while True:
        m = server.metrics()
        if m["kda_slots_used"] == 0 and m["kda_kv_tokens_used"] == 0 and m["kda_requests_running"] == 0:
            return m
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"still busy after {timeout} s: {m}")
        time.sleep(0.05)


def open_request(server, path, body, stream=False):
    """A request on a raw socket, its answer left unread (the caller reads or leaves it)."""
    s = socket.create_connection((server.host, server.port), timeout=60)
    data = json.dumps({**body, "stream": stream})
    s.sendall((f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(data)}\r\n\r\n{data}").encode())
    return s


def open_stream(server, body):
    return open_request(server, CMPL, body, stream=True)


def test_a_burst_on_an_idle_server_prefills_in_one_step(ckpt):
    """Eight streaming clients released together reach the idle engine a little apart (each request parsed
    and tokenized on its own thread): the admission window holds the engine's first step until the batch
    is full, so all eight prefill in one step and decode together: 6 tokens each in 6 steps."""
    server = Server(ckpt, "--max-batch", 8, "--admission-window-ms", 1000, "--context-length", CONTEXT,
                    "--kv-memory", "4MiB")
    try:
        before = server.metrics()
        go = threading.Barrier(8)
        results = [None] * 8

        def run(k):
            go.wait()
            results[k] = server.stream(CMPL, {"prompt": prompt_ids(400 + k, 12 + k), "max_tokens": 6,
                                              "temperature": 0, "ignore_eos": True})

        threads = [threading.Thread(target=run, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for events in results:
            assert events[-1] == "[DONE]" and stream_text(events, chat=False)[1] == "length"
        after = server.metrics()
        delta = {k: after[k] - before[k] for k in after if "admission" in k or "steps" in k or "prompt" in k}
        assert after["kda_engine_steps_total"] - before["kda_engine_steps_total"] == 6, delta
        # One hold at most: none when all eight were in before the engine woke.
        assert after["kda_admission_waits_total"] - before["kda_admission_waits_total"] <= 1, delta
    finally:
        server.stop()


def test_clients_leaving_mid_stream_free_their_slots(ckpt):
    # A context long enough that the streams left behind cannot end before their clients go: they end by
    # abort only.
    server = Server(ckpt, "--max-batch", 16, "--context-length", 200000, "--kv-memory", "256MiB")
    try:
        leaving = [open_stream(server, {"prompt": prompt_ids(200 + k, 10), "max_tokens": 100000,
                                        "temperature": 0, "ignore_eos": True}) for k in range(8)]
        staying = [open_stream(server, {"prompt": prompt_ids(300 + k, 10), "max_tokens": 40, "temperature": 0,
                                        "ignore_eos": True}) for k in range(8)]
        for s in leaving:  # every stream has begun: its headers and first chunk arrived
            assert b"200" in s.recv(4096)
        t0 = time.monotonic()  # the long streams are admitted (the first chunk is sent before admission)
        while server.metrics()["kda_slots_used"] < 8:
            assert time.monotonic() - t0 < 30, "the streams were never admitted"
            time.sleep(0.01)
        assert server.metrics()["kda_kv_tokens_used"] >= 80
        for s in leaving:
            s.close()
        for s in staying:  # the other half reads its streams to the end
            data = b""
            while not data.endswith(b"0\r\n\r\n"):
                chunk = s.recv(65536)
                assert chunk, "stream ended early"
                data += chunk
            assert b"data: [DONE]" in data and b'"finish_reason":"length"' in data
            s.close()
        after = wait_idle(server)
        assert after['kda_requests_total{finish_reason="abort"}'] == 8
        assert after['kda_requests_total{finish_reason="length"}'] == 8
        answer_next(server)
    finally:
        server.stop()


def test_a_stream_left_while_it_waits_for_a_slot_is_aborted(ckpt):
    # Every slot busy: the last stream waits, its opening chunk sent, nothing more to write until a slot
    # frees. Its client leaving is seen on the socket, not at a write: it no longer waits.
    # Workers for every stream and the metrics' requests besides.
    server = Server(ckpt, "--max-batch", 2, "--threads", 16, "--context-length", 200000, "--kv-memory", "256MiB")
    try:
        long = {"max_tokens": 100000, "temperature": 0, "ignore_eos": True}
        slots = int(server.metrics()["kda_slots_total"])
        busy = [open_stream(server, {"prompt": prompt_ids(600 + k, 10), **long}) for k in range(slots)]
        t0 = time.monotonic()
        while server.metrics()["kda_slots_used"] < slots:
            assert time.monotonic() - t0 < 30, "the streams were never admitted"
            time.sleep(0.01)
        waiting = open_stream(server, {"prompt": prompt_ids(700, 10), **long})
        assert b"200" in waiting.recv(4096)
        assert server.metrics()["kda_requests_waiting"] == 1
        waiting.close()
        t0 = time.monotonic()
        while (m := server.metrics())["kda_requests_waiting"] > 0:
            assert time.monotonic() - t0 < 10, "the stream left behind still waits"
            time.sleep(0.01)
        assert m['kda_requests_total{finish_reason="abort"}'] == 1
        assert m["kda_slots_used"] == slots  # the others run on
        for s in busy:
            s.close()
        after = wait_idle(server)
        assert after['kda_requests_total{finish_reason="abort"}'] == slots + 1
        answer_next(server)
    finally:
        server.stop()


def test_clients_leaving_before_a_whole_answer_abort_it(ckpt):
    # As above, but the requests answer in one piece: the server learns that their clients left only by
    # watching the connections, since it writes nothing to them before the end.
    server = Server(ckpt, "--max-batch", 16, "--context-length", 200000, "--kv-memory", "256MiB")
    try:
        long = {"max_tokens": 100000, "temperature": 0, "ignore_eos": True}
        leaving = [open_request(server, CMPL, {"prompt": prompt_ids(400 + k, 10), **long}) for k in range(3)]
        leaving.append(open_request(server, CHAT, {**chat_body("a story, please"), "n": 2, **long}))
        t0 = time.monotonic()
        while server.metrics()["kda_slots_used"] < 5:
            assert time.monotonic() - t0 < 30, "the requests were never admitted"
            time.sleep(0.01)
        busy = server.metrics()
        assert busy["kda_kv_tokens_used"] >= 50 and busy["kda_requests_running"] == 4
        staying = open_request(server, CMPL, {"prompt": prompt_ids(500, 10), "max_tokens": 30,
                                              "temperature": 0, "ignore_eos": True})
        for s in leaving:
            s.close()
        data = b""
        while b'"finish_reason":"length"' not in data:  # the client that stayed gets its whole answer
            chunk = staying.recv(65536)
            assert chunk, f"answer ended early: {data!r}"
            data += chunk
        assert data.startswith(b"HTTP/1.1 200"), data
        staying.close()
        after = wait_idle(server)
        assert after['kda_requests_total{finish_reason="abort"}'] == 4
        assert after['kda_requests_total{finish_reason="length"}'] == 1
        assert after["kda_requests_waiting"] == 0
        answer_next(server)
    finally:
        server.stop()


def test_rss_is_flat_over_1000_requests(server):
    c = server.conn()

    def one(k):
        body = json.dumps({"prompt": prompt_ids(k % 50, 20 + k % 7), "max_tokens": 2, "temperature": 0,
                           "logprobs": 1, "stop": ["zz"]})
        c.request("POST", CMPL, body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200
        r.read()

    for k in range(100):
        one(k)
    rss0 = server.rss_kb()
    for k in range(1000):
        one(k)
    rss1 = server.rss_kb()
    c.close()
    print(f"RSS {rss0} kB after 100 requests, {rss1} kB after 1,100 ({rss1 - rss0:+d} kB)")
    assert rss1 - rss0 < 16 * 1024, f"RSS grew by {rss1 - rss0} kB over 1000 requests"


BAD = [
    # (path, raw body or JSON, status, param or None, a word of the message)
    (CHAT, "{not json", 400, None, "JSON"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\xff"}]}', 400, None, "JSON"),
    (CHAT, {"messages": "hi"}, 400, "messages", "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", "wizard"),
    (CHAT, chat_body("x", temperature=-1), 400, "temperature", "temperature"),
    (CHAT, chat_body("x", top_p="high"), 400, "top_p", "top_p"),
    (CHAT, chat_body("x", max_tokens=-3), 400, "max_tokens", "max_tokens"),
    (CHAT, chat_body("x", presence_penalty=9), 400, "presence_penalty", "presence_penalty"),
    (CHAT, {**chat_body("x"), "model": "gpt-4"}, 404, "model", "gpt-4"),
    (CMPL, {"prompt": "x", "n": 1000}, 400, "n", "n"),
    (CMPL, {"prompt": [1, 2, 512]}, 400, "prompt[2]", "512"),
    (CMPL, {"prompt": [5] * (CONTEXT + 1)}, 400, "prompt", "context"),
    (CMPL, {"prompt": [5] * 100, "max_tokens": CONTEXT}, 400, "max_tokens", "context"),
    (CMPL, {"prompt": [5] * 100, "max_tokens": 800, "n": 32}, 400, None, ""),  # beyond the KV pool
    (CMPL, {"prompt": "x", "stop_token_ids": [600]}, 400, "stop_token_ids[0]", "600"),
    (CMPL, {"prompt": "x", "logprobs": 9}, 400, "logprobs", "logprobs"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_requests(server, case):
    path, body, status, param, word = BAD[case]
    if isinstance(body, (str, bytes)):
        got_status, got = server.request("POST", path, raw=body)
    else:
        got_status, got = server.post(path, body)
    assert got_status == status, got
    err = got["error"]
    assert err["type"] == "invalid_request_error" and err["code"] is None
    if param is not None:
        assert err["param"] == param, err
    assert word in err["message"], err
    answer_next(server)


def test_bad_transport(server):
    # Body too large, unknown path, NaN (not JSON), then the server still answers.
    status, got = server.request("POST", CMPL, raw=b"{" + b" " * (5 << 20) + b"}")
    assert status == 413 and "larger" in got["error"]["message"]
    answer_next(server)
    status, got = server.request("GET", "/v2/nothing")
    assert status == 404 and "not found" in got["error"]["message"]
    status, got = server.request("POST", CMPL, raw='{"prompt": "x", "temperature": NaN}')
    assert status == 400
    answer_next(server)
    # A header line beyond cpp-httplib's bound (8 KB).
    status, got = server.request("POST", CMPL, {"prompt": "x", "max_tokens": 1}, headers={"X-Big": "a" * 20000})
    assert status == 400 and got["error"]["type"] == "invalid_request_error"
    answer_next(server)


def test_api_key(ckpt):
    s = Server(ckpt, "--api-key", "sekret", "--max-batch", 4, "--kv-memory", "4MiB")
    try:
        assert s.request("GET", "/health")[0] == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            status, got = s.post(CMPL, {"prompt": "x", "max_tokens": 1}, headers=headers)
            assert status == 401 and got["error"]["code"] == "invalid_api_key"
            assert s.request("GET", "/v1/models", headers=headers)[0] == 401
            assert s.request("GET", "/metrics", headers=headers)[0] == 401
        ok = {"Authorization": "Bearer sekret"}
        status, got = s.post(CMPL, {"prompt": "x", "max_tokens": 1}, headers=ok)
        assert status == 200 and got["usage"]["completion_tokens"] == 1
        assert s.request("GET", "/v1/models", headers=ok)[0] == 200
    finally:
        s.stop()


def test_cli_refuses_what_it_cannot_serve(server, ckpt):
    import kda_paths

    def run(*args):
        return subprocess.run([str(kda_paths.BINARY), "serve", *map(str, args)], capture_output=True, text=True,
                              timeout=120)

    r = run()
    assert r.returncode != 0 and "--model DIR or --synthetic" in r.stderr
    r = run("--model", ckpt / "missing")
    assert r.returncode != 0 and "missing" in r.stderr
    # The port the module's server holds: an error naming host:port.
    r = run("--model", ckpt, "--port", server.port, "--kv-memory", "4MiB")
    assert r.returncode == 2 and f"127.0.0.1:{server.port}" in r.stderr, r.stderr
    r = run("--model", ckpt, "--context-length", 100000, "--kv-memory", "1MiB")
    assert r.returncode == 2 and "--context-length" in r.stderr, r.stderr
    for w in ("-1", "1001", "nan"):
        r = run("--model", ckpt, "--admission-window-ms", w)
        assert r.returncode != 0 and "--admission-window-ms" in r.stderr, r.stderr
    answer_next(server)


def test_synthetic_quick_start(tmp_path):
    """The README's quick start on a smaller synthetic model: one command starts it, one curl streams."""
    if shutil.which("curl") is None:
        pytest.skip("no curl")
    s = Server(None, "--layers", 1, "--vocab", 1024, "--kv-memory", "4MiB", log_dir=tmp_path)
    try:
        out = subprocess.run(
            ["curl", "-sN", f"http://127.0.0.1:{s.port}{CHAT}", "-H", "Content-Type: application/json", "-d",
             json.dumps({"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8, "stream": True})],
            capture_output=True, text=True, timeout=60, check=True).stdout
        events = parse_sse(out)
        assert events[-1] == "[DONE]"
        text, finish = stream_text(events)
        assert finish in ("length", "stop")
        status, body = s.post(CHAT, {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8,
                                     "return_token_ids": True})
        assert status == 200 and 1 <= body["usage"]["completion_tokens"] <= 8
        assert all(0 <= t < 1024 for t in body["choices"][0]["token_ids"])
    finally:
        s.stop()


def test_speculative_ngram_server_streams_the_same_greedy_text(server, ckpt):
    """`--speculative ngram`: greedy streams equal a plain server's, drafts are verified (/metrics), and a
    seeded sampled request is reproducible."""
    spec = Server(ckpt, "--max-batch", 4, "--context-length", CONTEXT, "--kv-memory", "4MiB",
                  "--speculative", "ngram", "--draft-tokens", 3)
    try:
        prompts = ["abcabcabcabcabc", "the cat and the cat and the cat and the", "1 2 3 1 2 3 1 2 3 1 2"]
        for p in prompts:
            body = {"prompt": p, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            plain_events = server.stream(CMPL, body)
            spec_events = spec.stream(CMPL, body)
            assert plain_events[-1] == "[DONE]" and spec_events[-1] == "[DONE]"
            assert stream_text(spec_events, chat=False) == stream_text(plain_events, chat=False), p
        m = spec.metrics()
        assert m["kda_spec_draft_tokens_total"] > 0
        assert 0 <= m["kda_spec_accepted_tokens_total"] <= m["kda_spec_draft_tokens_total"]
        assert server.metrics()["kda_spec_draft_tokens_total"] == 0
        seeded = {"prompt": prompts[0], "max_tokens": 24, "temperature": 0.8, "seed": 7, "ignore_eos": True}
        first = spec.post(CMPL, seeded)
        again = spec.post(CMPL, seeded)
        assert first[0] == 200 and again[0] == 200
        assert first[1]["choices"][0]["text"] == again[1]["choices"][0]["text"]
        assert wait_idle(spec)["kda_slots_used"] == 0
    finally:
        spec.stop()


def test_a_repeated_chat_hits_the_prefix_cache(server):
    body = chat_body("a question asked twice, word for word: what is a hybrid prefix cache?", max_tokens=12,
                     temperature=0)
    status, first = server.post(CHAT, body)
    assert status == 200, first
    status, second = server.post(CHAT, body)
    assert status == 200, second
    # The second prompt resumes from the first one's cached state and MLA KV rows: the same text.
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["usage"]["prompt_tokens"]
    m = wait_idle(server)
    assert m["kda_cached_tokens_total"] >= cached
    assert m["kda_prefix_cache_kv_tokens"] > 0 and m["kda_prefix_cache_bytes"] > 0
