"""``python -m rollpoint`` is the ``rollpoint`` command, and :func:`main` the console script.

The command comes with the ``cli`` extra (typer, rich): without it, :func:`main` refuses in
one line naming the extra, where importing :mod:`rollpoint.app.cli` would end in a traceback.
"""

import sys

from rollpoint.common.extras import extra_message, missing


def main() -> None:
    if missing("cli"):
        sys.stderr.write(f"error: {extra_message('cli', 'the rollpoint command')}\n")
        raise SystemExit(2)
    from rollpoint.app.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
