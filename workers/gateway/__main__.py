"""``python -m warmloop.workers.gateway [--host H] [--port P]``: the OpenAI-compatible
gateway in the foreground (``warmloop gateway``; the embedded stack's ``gateway``
part). Port: ``WARMLOOP_GATEWAY_PORT`` (8500) unless given."""

from __future__ import annotations

import argparse

from warmloop.workers.gateway.app import serve
from warmloop.workers.logging import configure_logging
from warmloop.workers.settings import Settings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=None)
    args = parser.parse_args(argv)
    settings = Settings()
    configure_logging(settings.log_format, settings.log_level)
    serve(settings, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
