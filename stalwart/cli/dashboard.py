"""`stalwart dashboard DIR`: a live web dashboard of a run, or of the runs under a directory (localhost)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from stalwart.config.arguments import ArgumentParser
from stalwart.errors import UserError


def main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="stalwart dashboard", description=(
        "Serve a self-contained dashboard of a run directory, or of a directory of runs to compare: loss / eval "
        "loss, learning rate, gradient norm, tokens/s, MFU and step-time curves (zoom, hover, smoothing, log "
        "scale), the per-rank heat map, stragglers, goodput, events, flight-recorder findings and profiler "
        "traces. It follows running jobs: the page fetches only new steps. JSON API under /api/, a Perfetto "
        "trace at /trace.json."))
    ap.add_argument("run_dir", help="a run directory (e.g. runs/default) or a directory of runs (e.g. runs)")
    ap.add_argument("--port", type=int, default=8765, help="port (0 = any free port; default 8765)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    args = ap.parse_args(argv)
    if not Path(args.run_dir).is_dir():
        raise UserError(f"no directory at {args.run_dir}: give a run directory or a directory of runs")
    if not 0 <= args.port <= 65535:
        ap.error(f"--port must be within 0-65535 (got {args.port})")
    from stalwart.observe.server import make_server

    try:
        server = make_server(args.run_dir, args.host, args.port)
    except socket.gaierror as e:
        raise UserError(f"--host: cannot resolve {args.host!r} ({e.strerror}); give an address such as "
                        "127.0.0.1") from None
    except OSError as e:
        raise UserError(f"--port: cannot listen on {args.host}:{args.port} ({e.strerror}); choose another "
                        "--port, or 0 for any free one") from None
    host, port = server.server_address[:2]
    print(f"stalwart dashboard: serving {args.run_dir} at http://{host}:{port}/  (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
