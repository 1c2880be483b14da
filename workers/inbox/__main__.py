"""``python -m warmloop.workers.inbox``: the web inbox and approvals API, with the
payload codec server mounted at /codec when a payload key is set (the embedded
stack runs it as its ``inbox`` part; ``warmloop ui`` runs it in the foreground)."""

from __future__ import annotations

from starlette.routing import BaseRoute, Mount

from warmloop.workers.clients import data_converter
from warmloop.workers.identity import AuthError, bearer_token, verifier_from_settings
from warmloop.workers.inbox.app import serve
from warmloop.workers.logging import configure_logging
from warmloop.workers.settings import Settings


def codec_mounts(settings: Settings) -> list[BaseRoute]:
    """The codec server the Temporal Web UI decodes payloads with, for verified people
    only (the Web UI sends their bearer token); none without a payload key."""
    codec = data_converter(settings).payload_codec
    if codec is None:
        return []
    from warmloop.workers.codec_server import codec_app

    verifier = verifier_from_settings(settings)

    def authorize(header: str | None) -> bool:
        token = bearer_token(header)
        if token is None:
            return False
        try:
            return bool(verifier.verify(token).roles)
        except AuthError:
            return False

    ui = settings.temporal_ui_port
    return [Mount("/codec", codec_app(codec, authorize=authorize, allowed_origins=[
        f"http://127.0.0.1:{ui}", f"http://localhost:{ui}"]))]


def main(host: str = "127.0.0.1", port: int | None = None) -> None:
    settings = Settings()
    configure_logging(settings.log_format, settings.log_level)
    serve(settings, host=host, port=port, mounts=codec_mounts(settings))


if __name__ == "__main__":
    main()
