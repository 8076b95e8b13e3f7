"""bench/bench_serving.py (the load generator) against a fake OpenAI-compatible server started here: an
http.server in a thread that streams deterministic chunks with known delays, so the counts the run reports
are known exactly and its latencies must be at least the fake's delays (lower bounds only: a slow machine
may add time, never remove it)."""

import importlib.util
import json
import random
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import kda_paths
import pytest

SCRIPT = kda_paths.REPO / "bench" / "bench_serving.py"
TTFT_S = 0.15  # the fake's delay before a reply's first text chunk
ITL_S = 0.03  # and between its text chunks
PROMPT_EXTRA = 7  # the fake's usage.prompt_tokens: the prompt's words + this (tells usage from estimates)


def load_module():
    spec = importlib.util.spec_from_file_location("bench_serving", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bs = load_module()


class FakeHandler(BaseHTTPRequestHandler):
    """GET /v1/models; POST /v1/chat/completions and /v1/completions, streaming max_tokens one-word chunks
    (a chat reply opens with a role-only chunk sent at once, which TTFT must not count). A prompt with
    FAIL gets HTTP 500; one with NOUSAGE gets no usage chunk."""

    def log_message(self, *args):  # keep pytest's output clean
        pass

    def send_json(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        else:
            self.send_json(404, {"error": {"message": "not found"}})

    def event(self, obj):
        self.wfile.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")
        self.wfile.flush()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        chat = self.path == "/v1/chat/completions"
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        self.server.bodies.append((self.path, body))
        if "FAIL" in prompt:
            self.send_json(500, {"error": {"message": "the fake fails this prompt"}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the stream ends when the connection closes

        def choice(text):
            return {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}

        if chat:
            self.event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        n = body["max_tokens"]
        time.sleep(TTFT_S)
        for i in range(n):
            if i:
                time.sleep(ITL_S)
            self.event({"choices": [choice(f" w{i}")]})
        if "NOUSAGE" not in prompt:
            usage = {"prompt_tokens": len(prompt.split()) + PROMPT_EXTRA, "completion_tokens": n}
            self.event({"choices": [], "usage": usage})
        self.event(b"[DONE]")


@pytest.fixture(scope="module")
def fake():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeHandler)
    srv.daemon_threads = True
    srv.bodies = []
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def run_bench(fake, tmp_path, *args):
    """Runs the script as users do; returns (exit status, the JSON report, the request bodies it sent)."""
    out = tmp_path / "report.json"
    fake.bodies.clear()
    url = f"http://127.0.0.1:{fake.server_address[1]}"
    p = subprocess.run([sys.executable, str(SCRIPT), "--base-url", url, "--output-file", str(out), *args],
                       capture_output=True, text=True, timeout=120)
    assert out.exists(), p.stderr
    return p.returncode, json.loads(out.read_text()), list(fake.bodies), p.stdout


def test_chat_counts_and_latencies(fake, tmp_path):
    rc, rep, bodies, stdout = run_bench(fake, tmp_path, "--endpoint", "chat", "--num-prompts", "6",
                                        "--random-input-len", "30", "--random-output-len", "5")
    assert rc == 0, rep["errors"]
    assert (rep["completed"], rep["failed"], rep["num_prompts"]) == (6, 0, 6)
    assert len(bodies) == 6
    for path, b in bodies:  # what makes runs comparable: a fixed length, EOS ignored, usage asked for
        assert path == "/v1/chat/completions"
        assert b["model"] == "fake-model" and b["stream"] and b["stream_options"] == {"include_usage": True}
        assert b["max_tokens"] == 5 and b["ignore_eos"] is True and b["temperature"] == 0.0
        assert len(b["messages"][0]["content"].split()) == 30
    assert rep["token_counts"] == "server usage"
    assert rep["output_tokens"] == rep["requested_output_tokens"] == 30
    words = sum(len(b["messages"][0]["content"].split()) for _, b in bodies)
    assert rep["input_tokens"] == words + 6 * PROMPT_EXTRA
    assert rep["request_throughput"] == pytest.approx(6 / rep["duration_s"])
    assert rep["output_throughput"] == pytest.approx(30 / rep["duration_s"])
    # The fake's delays bound every latency from below: TTFT skips the role-only chunk sent at once, each
    # of the 4 gaps after the first text is an ITL, and a request lasts at least TTFT + 4 ITL.
    assert rep["ttft_ms"]["median"] >= TTFT_S * 1e3
    assert rep["itl_ms"]["median"] >= ITL_S * 1e3
    assert rep["tpot_ms"]["mean"] >= ITL_S * 1e3
    assert rep["e2e_ms"]["median"] >= (TTFT_S + 4 * ITL_S) * 1e3
    assert rep["duration_s"] >= TTFT_S + 4 * ITL_S
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        s = rep[key]
        assert s["median"] <= s["p90"] <= s["p99"] <= s["max"]
    assert "Serving benchmark" in stdout and "TTFT" in stdout


def test_completions_dataset_with_a_failure(fake, tmp_path):
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "one two three", "output_len": 2}, {"prompt": "FAIL here", "output_len": 3},
            {"prompt": "四 五 six", "output_len": 4}]
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    rc, rep, bodies, _ = run_bench(fake, tmp_path, "--endpoint", "completions", "--dataset", str(data),
                                   "--num-prompts", "6", "--request-rate", "50", "--no-ignore-eos")
    assert rc == 1  # a failed request fails the run
    assert (rep["completed"], rep["failed"]) == (4, 2)
    assert len(rep["errors"]) == 1 and "HTTP 500" in rep["errors"][0]
    assert sorted((b["prompt"], b["max_tokens"]) for _, b in bodies) == sorted(
        [(r["prompt"], r["output_len"]) for r in rows] * 2)
    assert all(p == "/v1/completions" and "ignore_eos" not in b for p, b in bodies)
    assert rep["output_tokens"] == 2 * (2 + 4)
    assert rep["input_tokens"] == 2 * (3 + 3 + 2 * PROMPT_EXTRA)
    assert rep["request_rate"] == 50


def test_estimated_counts_without_usage(fake, tmp_path):
    data = tmp_path / "prompts.txt"
    data.write_text("NOUSAGE a b c\nNOUSAGE d e\n", encoding="utf-8")
    rc, rep, _, _ = run_bench(fake, tmp_path, "--endpoint", "chat", "--dataset", str(data), "--num-prompts",
                              "2", "--random-output-len", "3")
    assert rc == 0, rep["errors"]
    assert rep["token_counts"].startswith("estimated")
    assert rep["output_tokens"] == 6  # the text chunks
    assert rep["input_tokens"] == 4 + 3  # the prompts' words


def test_unreachable_server_counts_failures(tmp_path):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeHandler)
    port = srv.server_address[1]
    srv.server_close()  # nothing listens there now
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--base-url", f"http://127.0.0.1:{port}", "--num-prompts",
                        "2", "--model", "m", "--output-file", str(out), "--json"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    rep = json.loads(p.stdout)
    assert (rep["completed"], rep["failed"]) == (0, 2)
    assert rep["ttft_ms"]["mean"] is None and "Connection" in rep["errors"][0]


def test_arrival_times():
    assert bs.arrival_times(5, float("inf"), 0) == [0.0] * 5
    t = bs.arrival_times(4000, 10.0, 3)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    gaps = [b - a for a, b in zip(t, t[1:])]
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(0.1, rel=0.05)  # exponential gaps: mean 1/rate, sd 1/rate
    assert sum((g - mean) ** 2 for g in gaps) / len(gaps) == pytest.approx(0.01, rel=0.15)
    assert t == bs.arrival_times(4000, 10.0, 3)  # seeded
    with pytest.raises(ValueError, match="request-rate"):
        bs.arrival_times(2, 0.0, 0)


def test_generated_prompts():
    args = bs.parse_args(["--num-prompts", "200", "--random-input-len", "40", "--random-output-len", "20",
                          "--random-range-ratio", "0.5", "--seed", "1"])
    reqs = bs.make_requests(args)
    assert len(reqs) == 200 and reqs == bs.make_requests(args)
    assert all(20 <= len(p.split()) <= 40 for p, _ in reqs) and len({len(p.split()) for p, _ in reqs}) > 5
    assert all(10 <= n <= 20 for _, n in reqs) and len({n for _, n in reqs}) > 5
    text = "".join(p for p, _ in reqs)
    assert any("\u4e00" <= ch <= "\u9fff" for ch in text) and any("a" <= ch <= "z" for ch in text)
    rng = random.Random(0)
    assert {bs.drawn_length(rng, 8, 1.0) for _ in range(20)} == {8}
    assert {bs.drawn_length(rng, 8, 0.0) for _ in range(400)} == set(range(1, 9))


def test_dataset_files(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("first prompt\n\nsecond one\n", encoding="utf-8")
    assert bs.load_dataset(text, 9) == [("first prompt", 9), ("second one", 9)]
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 3}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"b.jsonl:2: .*string \"prompt\""):
        bs.load_dataset(bad, 9)
    bad.write_text('{"prompt": "ok", "output_len": 0}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"b.jsonl:1: \"output_len\" must be an integer >= 1"):
        bs.load_dataset(bad, 9)


def test_percentile_matches_linear_interpolation():
    v = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert bs.percentile(v, 50) == 3.0
    assert bs.percentile(v, 90) == pytest.approx(4.0 + 0.6 * 6.0)
    assert bs.percentile(v, 100) == 10.0 and bs.percentile([5.0], 99) == 5.0
    s = bs.summary_ms([0.001, 0.003])
    assert s == pytest.approx({"mean": 2.0, "median": 2.0, "p90": 2.8, "p99": 2.98, "max": 3.0})


def kda_has_serve():
    if not kda_paths.BINARY.exists():
        return False
    p = subprocess.run([str(kda_paths.BINARY), "serve", "--help"], capture_output=True, text=True, timeout=60)
    return p.returncode == 0 and "--synthetic" in p.stdout


@pytest.fixture(scope="module")
def kda_server():
    """`kda serve` on small synthetic weights (the first decoder layer, a 1024-token vocabulary: it starts
    in seconds) on a free port; yields its URL."""
    import socket
    import urllib.request

    if not kda_has_serve():
        pytest.skip("the kda binary has no `serve` subcommand")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(kda_paths.BINARY), "serve", "--synthetic", "--layers", "1", "--vocab", "1024",
                             "--host", "127.0.0.1", "--port", str(port),
                             "--state-memory", "256MiB", "--kv-memory", "256MiB"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, proc.stderr.read()
            assert time.time() < deadline, "kda serve did not answer /health within 120 s"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_against_kda_serve(kda_server, tmp_path, endpoint):
    """A short run against the real server: every request gets its max_tokens (ignore_eos), the server's
    usage counts add up, and each reply's first token comes before its end."""
    out = tmp_path / "report.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--base-url", kda_server, "--endpoint", endpoint,
                        "--num-prompts", "4", "--request-rate", "20", "--random-input-len", "12",
                        "--random-output-len", "5", "--random-range-ratio", "0.5", "--output-file", str(out)],
                       capture_output=True, text=True, timeout=300)
    rep = json.loads(out.read_text())
    assert p.returncode == 0, rep["errors"]
    assert (rep["completed"], rep["failed"]) == (4, 0)
    assert rep["model"] == "kimi-linear"  # from GET /v1/models
    assert rep["token_counts"] == "server usage"
    assert rep["output_tokens"] == rep["requested_output_tokens"]
    assert rep["input_tokens"] >= 4 * 6  # at least a token a word
    assert 0 < rep["ttft_ms"]["median"] <= rep["e2e_ms"]["median"]
