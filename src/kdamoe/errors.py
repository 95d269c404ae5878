"""User-facing errors of the kdamoe command-line tools.

A `UsageError` is a problem with what the user asked for (a flag value, a file, a folder), not a bug: `run_cli` prints
it as one line on stderr, `PROG: error: MESSAGE`, and exits with status 2, as argparse does for a bad flag. Any other
exception keeps its traceback. `UsageError` is a `ValueError`, so library callers may catch either.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


class UsageError(ValueError):
    """A problem with the user's input; the command-line tools report it in one line and exit with status 2."""


def run_cli(prog: str, main: Callable, argv: list[str] | None = None):
    """`main(argv)`, with a `UsageError` reported as one line on stderr and exit status 2."""
    try:
        return main(argv)
    except UsageError as error:
        print(f"{prog}: error: {' '.join(str(error).splitlines())}", file=sys.stderr)
        raise SystemExit(2) from None


def check_safetensors(folder: str | Path, advice: str) -> None:
    """Raise `UsageError` naming the first `*.safetensors` file of `folder` that safetensors cannot open (truncated or
    overwritten), followed by `advice`: safetensors' own message does not say which file is damaged."""
    from safetensors import SafetensorError, safe_open

    for file in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except SafetensorError as error:
            raise UsageError(f"{file} is damaged ({file.stat().st_size:,} bytes; safetensors: {error}); {advice}"
                             ) from error


__all__ = ["UsageError", "check_safetensors", "run_cli"]
