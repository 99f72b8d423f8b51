"""A stand-in for ``python -m sglang.launch_server`` in tests: a tiny http.server on a loopback port.

It accepts launch_server's flags (``--port`` and ``--host`` are used), writes its argv as JSON to
$FAKE_SGLANG_ARGV, and behaves per $FAKE_SGLANG_MODE:
  ok     /health is 200 after $FAKE_SGLANG_DELAY seconds; /v1/completions answers deterministically
  never  /health is always 503
  crash  prints an error and exits 3
With $FAKE_SGLANG_CHILD it also starts a sleeping child (pid written there) to check group teardown.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

START = time.monotonic()
MODE = os.environ.get("FAKE_SGLANG_MODE", "ok")
DELAY = float(os.environ.get("FAKE_SGLANG_DELAY", "0"))
ANSWER = "Natalia sold 48/2 = 24 clips.\n#### 18\n\nQuestion: ignored"


def logprob(token: int, pos: int) -> float:
    return -(((token * 7 + pos) % 13) + 1) / 4.0


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep the log readable
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            ok = MODE == "ok" and time.monotonic() - START >= DELAY
            self._send(200 if ok else 503, {"ok": ok})
        else:
            self._send(404, {})

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            self._send(404, {})
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompts = body["prompt"]
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        choices = []
        for i, toks in enumerate(prompts):
            if body.get("echo"):
                toks = list(toks) + [0]
                lps = [None] + [logprob(t, p) for p, t in enumerate(toks) if p > 0]
                tops = [None] + [{"x": max(lp, -0.5)} for lp in lps[1:]]
                logprobs = {"token_logprobs": lps, "top_logprobs": tops}
                choices.append({"index": i, "text": "", "logprobs": logprobs})
            else:
                choices.append({"index": i, "text": ANSWER})
        self._send(200, {"choices": choices})


def main() -> None:
    argv = sys.argv[1:]
    if os.environ.get("FAKE_SGLANG_ARGV"):
        with open(os.environ["FAKE_SGLANG_ARGV"], "w") as fh:
            json.dump(argv, fh)
    port = int(argv[argv.index("--port") + 1])
    host = argv[argv.index("--host") + 1] if "--host" in argv else "127.0.0.1"
    if os.environ.get("FAKE_SGLANG_CHILD"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.environ["FAKE_SGLANG_CHILD"], "w") as fh:
            fh.write(str(child.pid))
    print(f"fake sglang: mode={MODE} port={port}", flush=True)
    if MODE == "crash":
        print("RuntimeError: CUDA error: no kernel image is available (fake)", flush=True)
        sys.exit(3)
    ThreadingHTTPServer((host, port), Handler).serve_forever()


if __name__ == "__main__":
    main()
