#!/usr/bin/env python3
"""A load generator for any OpenAI-compatible server (`kda serve`, vLLM, sglang, llama-server), after
sglang's bench_serving: requests arrive as a Poisson process at --request-rate (inf: all at once), each
streams its reply, and the run reports throughput and TTFT / ITL / TPOT / end-to-end latency statistics.

    python3 bench/bench_serving.py --base-url http://127.0.0.1:8000 --endpoint chat \
        --num-prompts 64 --request-rate 4 --random-input-len 1000 --random-output-len 128

Prompts come from --dataset FILE (JSONL lines {"prompt": "...", "output_len": N}, or plain text lines, one
prompt each, with --random-output-len tokens), else they are generated: words drawn from a mixed English /
Chinese list, --random-input-len words each (times a factor drawn from [--random-range-ratio, 1]). Every
request asks for exactly its output length (max_tokens, and ignore_eos as vLLM / sglang / kda accept it) so
that runs are comparable. Standard library only: one thread per request, http.client, no aiohttp.

Token counts are the server's (stream_options.include_usage); a server that sends no usage gets its output
counted as the text chunks it streamed and its input as the prompt's words (the report says which).
Definitions: TTFT, the request's send to its first chunk with text; ITL, the gaps between consecutive text
chunks; TPOT, (E2E - TTFT) / (output tokens - 1) per request with more than one token; E2E, send to the
stream's end. Duration: the first request's send to the last one's end.
"""

import argparse
import http.client
import json
import math
import os
import random
import sys
import threading
import time
import urllib.parse

# Words of generated prompts. English words are about one token each in a BPE vocabulary; the Chinese
# ones one or two. A prompt mixes them so that both scripts' pre-tokenizer paths run.
ENGLISH_WORDS = (
    "the of and to in is was for on that with as by at from his it an were are which this be or has had "
    "not but first one their its new after who they have her she two been other when there all during into "
    "school time may years more most only over city some world would where later up such used many can "
    "state about national out known university united then made also american three under second game "
    "team part year between both through film music people well series history being before became these "
    "system since life number around four against group high any while each north south river house"
).split()
CHINESE_WORDS = (
    "我们 你们 他们 时间 世界 国家 城市 学校 大学 音乐 电影 历史 系统 生活 数字 问题 方法 工作 今天 明天 "
    "因为 所以 但是 如果 已经 可以 需要 发展 经济 社会 文化 科学 技术 语言 模型 数据 计算 网络 服务 请求 "
    "的 是 在 有 和 人 这 中 大 为 上 个 国 我 以 要 他 时 来 用 们 生 到 作 地 于 出 就 分 对 成 会 可"
).split()


def generated_prompt(rng, words, chinese_share=0.3):
    """`words` words separated by spaces (so the prompt's word count is `words`), each Chinese with
    probability chinese_share, else English."""
    return " ".join(rng.choice(CHINESE_WORDS if rng.random() < chinese_share else ENGLISH_WORDS)
                    for _ in range(words))


def drawn_length(rng, length, ratio):
    """A length uniform in [max(1, floor(length * ratio)), length], as sglang's random dataset draws it."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"--random-range-ratio: {ratio} is not in [0, 1]")
    if length < 1:
        raise ValueError(f"length {length} is not >= 1")
    return rng.randint(max(1, int(length * ratio)), length)


def load_dataset(path, default_output_len):
    """[(prompt, output_len)] from a JSONL file of {"prompt", "output_len"?} objects, or from a text file
    (one prompt a line). The first non-empty line decides which: a JSON object makes it JSONL, and then
    every line must be one (the error names the line)."""
    with open(path, encoding="utf-8") as f:
        lines = [(i + 1, line.rstrip("\n")) for i, line in enumerate(f) if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no prompts")
    try:
        jsonl = isinstance(json.loads(lines[0][1]), dict)
    except json.JSONDecodeError:
        jsonl = False
    if not jsonl:
        return [(text, default_output_len) for _, text in lines]
    out = []
    for no, line in lines:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{no}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise ValueError(f'{path}:{no}: expected an object with a string "prompt"')
        n = obj.get("output_len", default_output_len)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f'{path}:{no}: "output_len" must be an integer >= 1, got {n!r}')
        out.append((obj["prompt"], n))
    return out


def make_requests(args):
    """The run's [(prompt, output_len)]: the dataset's (cycled to --num-prompts) or generated ones."""
    rng = random.Random(args.seed)
    if args.dataset:
        data = load_dataset(args.dataset, args.random_output_len)
        return [data[i % len(data)] for i in range(args.num_prompts)]
    return [
        (
            generated_prompt(rng, drawn_length(rng, args.random_input_len, args.random_range_ratio)),
            drawn_length(rng, args.random_output_len, args.random_range_ratio),
        )
        for _ in range(args.num_prompts)
    ]


def arrival_times(n, rate, seed):
    """Send offsets in seconds of n requests: a Poisson process at `rate` requests/s (exponential gaps,
    the first at 0), all 0 for rate inf."""
    if not rate > 0:
        raise ValueError(f"--request-rate: {rate} is not > 0")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 1)  # not the prompts' stream: changing the rate keeps the prompts
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def percentile(sorted_values, q):
    """numpy's default (linear) percentile of a sorted list; NaN for an empty one."""
    if not sorted_values:
        return float("nan")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summary_ms(values_s):
    """mean / median / p90 / p99 / max in milliseconds of values in seconds (null when there are none:
    the report stays strict JSON)."""
    v = sorted(x * 1e3 for x in values_s)
    if not v:
        return dict.fromkeys(("mean", "median", "p90", "p99", "max"))
    return {"mean": sum(v) / len(v), "median": percentile(v, 50), "p90": percentile(v, 90),
            "p99": percentile(v, 99), "max": v[-1]}


class Target:
    """Where requests go: scheme, host, port and path prefix of --base-url, the headers every one sends."""

    def __init__(self, base_url, api_key, timeout):
        u = urllib.parse.urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"--base-url: {base_url!r} is not an http(s)://host[:port] URL")
        self.https = u.scheme == "https"
        self.host = u.hostname
        self.port = u.port or (443 if self.https else 80)
        self.prefix = u.path.rstrip("/")
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def connect(self):
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def get_json(self, path):
        conn = self.connect()
        try:
            conn.request("GET", self.prefix + path, headers=self.headers)
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {resp.status}: {body[:200]!r}")
            return json.loads(body)
        finally:
            conn.close()


def request_body(args, model, prompt, output_len):
    body = {"model": model, "max_tokens": output_len, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if model is None:
        del body["model"]
    return body


def chunk_text(endpoint, chunk):
    """The generated text one streamed chunk carries (every choice's), '' when none."""
    out = []
    for c in chunk.get("choices") or []:
        if endpoint == "chat":
            out.append((c.get("delta") or {}).get("content") or "")
        else:
            out.append(c.get("text") or "")
    return "".join(out)


def run_one(target, path, endpoint, body, prompt_words):
    """Sends one streaming request and reads its server-sent events; returns its record (never raises)."""
    rec = {"success": False, "error": "", "ttft": None, "itl": [], "e2e": None, "chunks": 0,
           "prompt_tokens": None, "completion_tokens": None, "prompt_words": prompt_words, "text_len": 0}
    conn = None
    t0 = time.perf_counter()
    try:
        conn = target.connect()
        conn.request("POST", target.prefix + path, body=json.dumps(body).encode(), headers=target.headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}")
        last, done = None, False
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, event names
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"error event: {json.dumps(chunk['error'])[:300]}")
            usage = chunk.get("usage")
            if usage:
                rec["prompt_tokens"] = usage.get("prompt_tokens")
                rec["completion_tokens"] = usage.get("completion_tokens")
            text = chunk_text(endpoint, chunk)
            if not text:
                continue  # a role-only or usage-only chunk
            now = time.perf_counter()
            if last is None:
                rec["ttft"] = now - t0
            else:
                rec["itl"].append(now - last)
            last = now
            rec["chunks"] += 1
            rec["text_len"] += len(text)
        if not done:
            raise RuntimeError("the stream ended without data: [DONE]")
        if last is None:
            raise RuntimeError("no text was streamed")
        rec["e2e"] = time.perf_counter() - t0
        rec["success"] = True
    except Exception as e:  # noqa: BLE001  (a failed request is counted, the run goes on)
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        if conn is not None:
            conn.close()
    return rec


def run_benchmark(args):
    """Sends the requests on their schedule and returns the report (a dict)."""
    target = Target(args.base_url, args.api_key, args.timeout)
    model = args.model
    if model is None:
        try:
            models = target.get_json("/v1/models").get("data") or []
            model = models[0]["id"] if models else None
        except Exception as e:  # noqa: BLE001  (the model field is optional for many servers)
            print(f"bench_serving: GET /v1/models failed ({e}); requests name no model", file=sys.stderr)
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    reqs = make_requests(args)
    offsets = arrival_times(len(reqs), args.request_rate, args.seed)
    records = [None] * len(reqs)
    limit = threading.BoundedSemaphore(args.max_concurrency) if args.max_concurrency else None

    def worker(i, body, words):
        try:
            records[i] = run_one(target, path, args.endpoint, body, words)
        finally:
            if limit:
                limit.release()

    threads = []
    start = time.perf_counter()
    for i, ((prompt, out_len), off) in enumerate(zip(reqs, offsets)):
        delay = start + off - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        if limit:
            limit.acquire()
        body = request_body(args, model, prompt, out_len)
        t = threading.Thread(target=worker, args=(i, body, len(prompt.split())), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    duration = time.perf_counter() - start
    return report(args, model, reqs, records, duration)


def report(args, model, reqs, records, duration):
    ok = [r for r in records if r["success"]]
    failed = [r for r in records if not r["success"]]
    server_in = all(r["prompt_tokens"] is not None for r in ok)
    server_out = all(r["completion_tokens"] is not None for r in ok)
    in_tok = sum(r["prompt_tokens"] if server_in else r["prompt_words"] for r in ok)
    out_counts = [r["completion_tokens"] if server_out else r["chunks"] for r in ok]
    out_tok = sum(out_counts)
    tpot = [(r["e2e"] - r["ttft"]) / (n - 1) for r, n in zip(ok, out_counts) if n > 1]
    itl = [x for r in ok for x in r["itl"]]
    rate = args.request_rate
    return {
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model": model,
        "request_rate": None if math.isinf(rate) else rate,  # null: all at once
        "max_concurrency": args.max_concurrency or None,
        "num_prompts": len(reqs),
        "completed": len(ok),
        "failed": len(failed),
        "errors": sorted({r["error"] for r in failed})[:10],
        "duration_s": duration,
        "input_tokens": in_tok,
        "output_tokens": out_tok,
        "requested_output_tokens": sum(n for _, n in reqs),
        "token_counts": "server usage" if server_in and server_out else "estimated (no usage from the server)",
        "request_throughput": len(ok) / duration,
        "input_throughput": in_tok / duration,
        "output_throughput": out_tok / duration,
        "total_throughput": (in_tok + out_tok) / duration,
        "ttft_ms": summary_ms([r["ttft"] for r in ok]),
        "itl_ms": summary_ms(itl),
        "tpot_ms": summary_ms(tpot),
        "e2e_ms": summary_ms([r["e2e"] for r in ok]),
    }


def table(rep):
    rows = [
        ("Endpoint", rep["endpoint"]),
        ("Request rate (req/s)", "inf" if rep["request_rate"] is None else rep["request_rate"]),
        ("Max concurrency", rep["max_concurrency"] or "-"),
        ("Completed / failed requests", f"{rep['completed']} / {rep['failed']}"),
        ("Duration (s)", rep["duration_s"]),
        ("Input tokens", rep["input_tokens"]),
        ("Output tokens", f"{rep['output_tokens']} (of {rep['requested_output_tokens']} asked)"),
        ("Token counts", rep["token_counts"]),
        ("Request throughput (req/s)", rep["request_throughput"]),
        ("Input throughput (tok/s)", rep["input_throughput"]),
        ("Output throughput (tok/s)", rep["output_throughput"]),
        ("Total throughput (tok/s)", rep["total_throughput"]),
    ]
    lines = ["=" * 22 + " Serving benchmark " + "=" * 22]
    for k, v in rows:
        lines.append(f"{k:<32}{v:>31.2f}" if isinstance(v, float) else f"{k:<32}{v!s:>31}")
    lines.append(f"{'(ms)':<13}" + "".join(f"{h:>10}" for h in ("mean", "median", "p90", "p99", "max")))
    for name, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_ms")):
        s = rep[key]
        # Two decimals while they fit the column, fewer for long latencies: columns never run together.
        cells = ["-" if s[q] is None else f"{s[q]:.2f}" if s[q] < 1e5 else f"{s[q]:.0f}"
                 for q in ("mean", "median", "p90", "p99", "max")]
        lines.append(f"{name:<13}" + "".join(f"{c:>10}" for c in cells))
    for e in rep["errors"]:
        lines.append(f"error: {e}")
    lines.append("=" * 63)
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                   help="/v1/chat/completions or /v1/completions (default %(default)s)")
    p.add_argument("--model", default=None, help="the model field (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""),
                   help="sent as Authorization: Bearer (default: $OPENAI_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s of the Poisson arrivals; inf (default): all at once")
    p.add_argument("--max-concurrency", type=int, default=0, help="at most this many in flight (0: no limit)")
    p.add_argument("--dataset", default=None, help="JSONL {prompt, output_len} or text lines (default: generated)")
    p.add_argument("--random-input-len", type=int, default=1024, help="generated prompts' words")
    p.add_argument("--random-output-len", type=int, default=128, help="tokens asked per request")
    p.add_argument("--random-range-ratio", type=float, default=1.0,
                   help="lengths drawn uniformly from [len x ratio, len] (default 1: fixed)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (replies may then stop before max_tokens)")
    p.add_argument("--seed", type=int, default=0, help="of the generated prompts and the arrival times")
    p.add_argument("--timeout", type=float, default=600.0, help="socket timeout per request, seconds")
    p.add_argument("--output-file", default=None, help="write the JSON report there")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    args = p.parse_args(argv)
    if args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    if args.max_concurrency < 0:
        p.error("--max-concurrency must be >= 0")
    if not args.request_rate > 0:
        p.error("--request-rate must be > 0 (inf: all at once)")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        p.error("--random-range-ratio must be in [0, 1]")
    if args.random_input_len < 1 or args.random_output_len < 1:
        p.error("--random-input-len and --random-output-len must be >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        rep = run_benchmark(args)
    except (ValueError, OSError) as e:
        print(f"bench_serving: {e}", file=sys.stderr)
        return 2
    if args.output_file:
        with open(args.output_file, "w", encoding="utf-8") as f:
            json.dump(rep, f, indent=2)
    print(json.dumps(rep, indent=2) if args.json else table(rep))
    return 0 if rep["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
