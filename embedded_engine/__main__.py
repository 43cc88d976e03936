"""``python -m embedded_engine --model-path DIR --host 127.0.0.1 --port P [...]``"""

from __future__ import annotations

import logging
import signal
import sys

from .server import serve
from .settings import parse_settings


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(argv)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # SIGTERM ends the process like Ctrl-C, so the scheduler thread and groups are torn down
    signal.signal(signal.SIGTERM, _raise_interrupt)
    serve(settings)


if __name__ == "__main__":
    main(sys.argv[1:])
