"""The entry points' argument parser: a usage error is two lines, not the whole option list.

argparse prints its full usage (every option: some 160 lines for the launcher) before the one line
that says what is wrong; here an error prints one usage line pointing to ``--help`` and the error,
with the closest flag for a misspelled one. ``--help`` still prints everything.
"""

from __future__ import annotations

import argparse
import difflib
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with a short :meth:`error` (exit status 2, as argparse's)."""

    def error(self, message: str) -> NoReturn:
        """Print ``usage: PROG [options] (--help lists them)`` and ``PROG: error: MESSAGE`` (one
        line each; a message of several lines is kept whole), then exit with status 2."""
        self.exit(2, f"usage: {self.prog} [options] (--help lists them)\n"
                     f"{self.prog}: error: {message}{self._suggestion(message)}\n")

    def _suggestion(self, message: str) -> str:
        """`` (did you mean --X?)`` for the first unrecognized flag close to one of ours."""
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return ""
        unknown = [tok.split("=", 1)[0] for tok in message[len(prefix):].split() if tok.startswith("--")]
        ours = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        for tok in unknown:
            close = difflib.get_close_matches(tok, ours, n=1, cutoff=0.75)
            if close:
                return f" (did you mean {close[0]}?)"
        return ""

