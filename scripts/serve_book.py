"""Serve the built book on this machine only: ``make serve`` (http://127.0.0.1:8000).

    python scripts/serve_book.py [--port 8000] [_build/html]

Opened as ``file://``, the book's pages work but its search cannot fetch the pages' text (browsers
block those requests), so results come without snippets and the console shows CORS errors. Over
this local server search works fully. It listens on 127.0.0.1 only: nothing outside this machine
can reach it. Stop it with Ctrl+C.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import sys
from pathlib import Path


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # one line per request drowns the address; errors still show
        pass


def make_server(directory: Path, port: int = 8000, host: str = "127.0.0.1") -> http.server.ThreadingHTTPServer:
    """An HTTP server for ``directory`` on ``host:port`` (port 0: any free port). Call serve_forever()."""
    directory = Path(directory)
    if not (directory / "index.html").exists():
        raise SystemExit(f"serve: {directory}/index.html not found: build the book first (`make book`)")
    handler = functools.partial(_QuietHandler, directory=str(directory))
    return http.server.ThreadingHTTPServer((host, port), handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="serve_book.py")
    parser.add_argument("directory", nargs="?", default="_build/html")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    try:
        server = make_server(Path(args.directory), args.port)
    except OSError as exc:
        print(f"serve: cannot listen on 127.0.0.1:{args.port} ({exc.strerror}); try `make serve PORT=8001`",
              file=sys.stderr)
        return 1
    host, port = server.server_address[:2]
    print(f"the book is at http://{host}:{port}/index.html (this machine only); Ctrl+C stops the server",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
