"""A local HTTP file server for the tests of data behind a URL (no network needed)."""

from __future__ import annotations

import contextlib
import functools
import http.server
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Served:
    """A running server: ``url`` of the folder, the ``requests`` (method, path) it answered."""

    url: str
    requests: list[tuple[str, str]] = field(default_factory=list)


@contextlib.contextmanager
def serve(
    folder: Path,
    *,
    status: Callable[[str, str], int | None] | None = None,
    header: tuple[str, str] | None = None,
) -> Iterator[Served]:
    """Serve ``folder`` over HTTP on 127.0.0.1 while the ``with`` block runs.

    Args:
        folder: what the server's root holds.
        status: ``(method, path) -> HTTP status`` to answer instead of the file (``None``:
            the file), for failures.
        header: ``(name, value)`` a request must carry, else it gets 403.
    """
    served = Served("")

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            """No line on stderr per request."""

        def _answer(self, method: str) -> bool:
            served.requests.append((method, self.path))
            code = status(method, self.path) if status else None
            if code is None and header and self.headers.get(header[0]) != header[1]:
                code = 403
            if code is None:
                return False
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return True

        def do_GET(self) -> None:
            if not self._answer("GET"):
                super().do_GET()

        def do_HEAD(self) -> None:
            if not self._answer("HEAD"):
                super().do_HEAD()

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Handler, directory=str(folder))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    served.url = f"http://127.0.0.1:{server.server_port}"
    try:
        yield served
    finally:
        server.shutdown()
        server.server_close()
