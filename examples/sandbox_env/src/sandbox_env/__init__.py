"""A file-sandbox environment for rollpoint, written as a third party would: public API only.

``environment: sandbox_env:SandboxEnvironment`` in a rollpoint config loads it;
:data:`TASKS` is the dataset file it ships. See this folder's README.md.
"""

from pathlib import Path

from sandbox_env.environment import SandboxEnvironment, SandboxState

TASKS = Path(__file__).with_name("tasks.jsonl")
"""The example's task dataset (JSONL task rows for ``dataset:``)."""

__all__ = ["TASKS", "SandboxEnvironment", "SandboxState"]
