"""A real HTTP server on loopback for image-URL tests: serves files, redirects, slow and huge
bodies, and records every request it sees (so a test can prove a refused URL was never fetched)."""

from __future__ import annotations

import http.server
import threading
import time
import urllib.parse


class MediaServer:
    def __init__(self, files: dict[str, bytes], host: str = "127.0.0.1") -> None:
        self.files = dict(files)
        self.requests: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                server.requests.append(self.path)
                path, _, query = self.path.partition("?")
                params = urllib.parse.parse_qs(query)
                if path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", params["to"][0])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif path == "/slow":
                    time.sleep(float(params.get("s", ["5"])[0]))
                    self._send(b"late")
                elif path == "/huge":
                    size = int(params["bytes"][0])
                    chunked = "chunked" in params
                    self.send_response(200)
                    if chunked:
                        self.send_header("Transfer-Encoding", "chunked")
                    else:
                        self.send_header("Content-Length", str(size))
                    self.end_headers()
                    block = b"\0" * 65536
                    sent = 0
                    try:
                        while sent < size:
                            piece = block[: min(len(block), size - sent)]
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                            sent += len(piece)
                        if chunked:
                            self.wfile.write(b"0\r\n\r\n")
                    except OSError:
                        pass  # the client stopped reading at its cap
                elif path in server.files:
                    self._send(server.files[path])
                else:
                    self.send_error(404)

            def _send(self, body: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                pass  # a client that stops reading at its byte cap or deadline is what some tests want

        self.server = Server((host, 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.host = host
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def url(self, path: str, host: str | None = None) -> str:
        return f"http://{host or self.host}:{self.port}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
