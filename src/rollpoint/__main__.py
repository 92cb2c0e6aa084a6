"""``python -m rollpoint`` is the ``rollpoint`` command."""

from rollpoint.cli import main

main()
