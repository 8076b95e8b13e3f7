"""`kda serve` for the tests: a checkpoint folder with a tokenizer (the tiny model dumps plus a
tiktoken-format vocabulary of its 256 single bytes and Kimi's special tokens), a server process on
127.0.0.1 at a free port, and small HTTP helpers (http.client) for JSON, server-sent events and /metrics."""

import base64
import http.client
import json
import os
import pathlib
import shutil
import signal
import subprocess
import threading
import time

import kda_paths

# Kimi's special tokens by offset from the first special id (the spec's known ids).
SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    17: "<|im_middle|>",
    254: "[UNK]",
    255: "[PAD]",
}


def write_tokenizer(folder, base=256):
    """tiktoken.model (the 256 single bytes, ranks 0..255) and tokenizer_config.json naming the specials:
    with the tiny model's vocab of 512, base + 256 specials fill it exactly."""
    folder = pathlib.Path(folder)
    with open(folder / "tiktoken.model", "w") as f:
        for i in range(base):
            f.write(f"{base64.b64encode(bytes([i])).decode()} {i}\n")
    dec = {
        str(base + k): {"content": name, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                        "special": True}
        for k, name in SPECIALS.items()
    }
    (folder / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": dec}))


def make_checkpoint(tmp):
    """The tiny model's config and weights with a tokenizer, in a fresh folder under tmp."""
    dst = pathlib.Path(tmp) / "tiny_ckpt"
    dst.mkdir()
    for name in ("config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                 "model-00002-of-00002.safetensors"):
        shutil.copy(kda_paths.TINY / name, dst / name)
    write_tokenizer(dst)
    return dst


class Server:
    """A `kda serve` process; stop() ends it (SIGTERM) and checks that it exits cleanly."""

    def __init__(self, model_dir, *args, log_dir=None):
        cmd = [str(kda_paths.BINARY), "serve", "--model", str(model_dir), "--port", "0", "--precision", "fp32",
               *map(str, args)]
        self.log = open(pathlib.Path(log_dir or model_dir) / f"serve-{os.getpid()}-{time.monotonic_ns()}.log", "w+")
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        line = self._first_line(timeout=120)
        prefix = "kda serve: listening on http://"
        if not line.startswith(prefix):
            self.proc.kill()
            raise RuntimeError(f"kda serve did not start: {line!r}\n{self.stderr()}")
        self.host, port = line[len(prefix):].strip().rsplit(":", 1)
        self.port = int(port)
        self.pid = self.proc.pid

    def _first_line(self, timeout):
        out = []
        t = threading.Thread(target=lambda: out.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        return out[0] if out else ""

    def stderr(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def conn(self, timeout=120):
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def request(self, method, path, body=None, headers=None, raw=None):
        """(status, parsed JSON or text) of one request on a fresh connection."""
        c = self.conn()
        try:
            data = raw if raw is not None else (json.dumps(body) if body is not None else None)
            h = {"Content-Type": "application/json", **(headers or {})}
            c.request(method, path, body=data, headers=h)
            r = c.getresponse()
            text = r.read().decode()
            ctype = r.getheader("Content-Type", "")
            return r.status, (json.loads(text) if "json" in ctype and text else text)
        finally:
            c.close()

    def post(self, path, body, headers=None):
        return self.request("POST", path, body, headers)

    def stream(self, path, body, headers=None):
        """Every data payload of a streamed response, [DONE] last (as the string)."""
        c = self.conn()
        try:
            c.request("POST", path, body=json.dumps({**body, "stream": True}),
                      headers={"Content-Type": "application/json", **(headers or {})})
            r = c.getresponse()
            assert r.status == 200, r.read()
            assert r.getheader("Content-Type", "").startswith("text/event-stream")
            return parse_sse(r.read().decode())
        finally:
            c.close()

    def metrics(self, headers=None):
        status, text = self.request("GET", "/metrics", headers=headers)
        assert status == 200, text
        return parse_metrics(text)

    def rss_kb(self):
        for line in pathlib.Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                raise RuntimeError("kda serve did not stop on SIGTERM\n" + self.stderr())
            assert rc == 0, f"kda serve exited with {rc}\n{self.stderr()}"
        self.log.close()


def parse_sse(text):
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def parse_metrics(text):
    """{name or name{labels}: value} of a Prometheus text page."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def stream_text(events, index=0, chat=True):
    """The concatenated text of one choice of a stream, and its finish reason."""
    text, finish = "", None
    for e in events:
        if e == "[DONE]" or not e["choices"]:
            continue
        for c in e["choices"]:
            if c["index"] != index:
                continue
            text += (c["delta"].get("content") or "") if chat else c["text"]
            finish = c["finish_reason"] or finish
    return text, finish
