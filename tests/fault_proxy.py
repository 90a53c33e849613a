"""A small fault-injecting HTTP proxy on 127.0.0.1, in front of a real server.

It forwards every request to the upstream server and streams the reply back
line by line (so server-sent events pass through as they come), and on demand:
answers the next N chat requests with a given status (429, 503), cuts a
stream after K events, or stalls one (stops sending, connection held open).
It records each chat request's headers, so a test can check what kvchat sent.
"""

from __future__ import annotations

import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP = {"transfer-encoding", "content-length", "connection", "keep-alive"}


class FaultProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.fail_next: list[int] = []  # statuses for the next chat requests, in order
        self.cut_after: int | None = None  # close the stream after this many events, once
        self.stall_after: int | None = None  # stop sending after this many events, once
        self.chat_headers: list[dict[str, str]] = []
        self.release = threading.Event()  # ends a stall
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                proxy._forward(self, None)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                proxy._forward(self, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def _forward(self, handler: BaseHTTPRequestHandler, body: bytes | None) -> None:
        chat = handler.path.endswith("/chat/completions")
        if chat:
            self.chat_headers.append({k.lower(): v for k, v in handler.headers.items()})
            if self.fail_next:
                status = self.fail_next.pop(0)
                payload = json.dumps({"error": {"message": f"injected {status}"}}).encode()
                handler.send_response(status)
                handler.send_header("Content-Type", "application/json")
                handler.send_header("Content-Length", str(len(payload)))
                handler.end_headers()
                handler.wfile.write(payload)
                return
        upstream = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=600)
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP}
        upstream.request(handler.command, handler.path, body=body, headers=headers)
        response = upstream.getresponse()
        handler.send_response(response.status)
        for key, value in response.getheaders():
            if key.lower() not in _HOP:
                handler.send_header(key, value)
        handler.send_header("Connection", "close")
        handler.end_headers()
        cut, stall = (self.cut_after, self.stall_after) if chat else (None, None)
        if chat:
            self.cut_after = self.stall_after = None  # once
        events = 0
        try:
            while True:
                line = response.readline()
                if not line:
                    break
                if line.startswith(b"data:"):
                    events += 1
                    if cut is not None and events > cut:
                        break  # the connection closes mid-stream
                    if stall is not None and events > stall:
                        self.release.wait(600)
                        break
                handler.wfile.write(line)
                handler.wfile.flush()
        except OSError:
            pass
        finally:
            upstream.close()
            handler.close_connection = True
