"""The buffer's command-line flags (slime's names where slime has one).

``--n-samples-per-prompt`` belongs to the rollout manager; it is read here to check group sizes.
"""

from __future__ import annotations

import argparse

from buffer.settings import BufferSettings, load_filter
from flags import add_flags, from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the buffer's flags: ``BufferSettings``' fields declare them."""
    add_flags(parser, BufferSettings)


def settings_from_args(args: argparse.Namespace) -> BufferSettings:
    """Build and validate the buffer's settings; ``ValueError`` names the offending flag."""
    settings = from_args(BufferSettings, args)  # validated as it is built
    load_filter(settings)
    return settings
