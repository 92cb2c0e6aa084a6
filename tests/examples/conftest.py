"""The example packages under examples/ are tested installed, as a user would have them.

``make`` installs them into the virtual environment (the Makefile's setup); without that,
every test here would fail on an import, so say what to run instead.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("sandbox_env") is None:
    raise pytest.UsageError(
        "the example package sandbox_env is not installed: pip install -e examples/sandbox_env"
        " (make does it)"
    )
