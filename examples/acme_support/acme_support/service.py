"""Acme's returns service: the HTTP endpoint behind the ``lookup_return`` tool.

``python -m acme_support.service --port 8765``. POST /returns/lookup with
``{"return_id": "R2003"}``; 404 for an unknown return (the model reads it). GET /stats
counts the lookups served.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from acme_support.data import RETURNS

_lock = threading.Lock()
STATS = {"lookups": 0, "idempotent_retries": 0}


class Handler(BaseHTTPRequestHandler):
    def _send(self, code: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/stats":
            with _lock:
                self._send(200, STATS)
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/returns/lookup":
            self._send(404, {"error": f"no endpoint {self.path}"})
            return
        try:
            args = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            return_id = args["return_id"]
        except (ValueError, KeyError, TypeError):
            self._send(400, {"error": "expected {\"return_id\": \"R....\"}"})
            return
        with _lock:
            STATS["lookups"] += 1
        record = RETURNS.get(return_id)
        if record is None:
            self._send(404, {"error": f"no return {return_id}"})
        else:
            self._send(200, {"return_id": return_id, **record})

    def log_message(self, format: str, *args: object) -> None:  # quiet
        return


def serve(port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8765)
    port = parser.parse_args().port
    print(f"acme returns service on http://127.0.0.1:{port}", flush=True)
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
