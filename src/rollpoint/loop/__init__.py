"""The built-in loop: ``rollpoint run``'s trainer, built on the trainer's façade only.

It is what a trainer of your own would be, with a simulated update: :func:`run_builtin`
opens :class:`rollpoint.Rollouts`, pulls each batch and applies
:class:`SimulatedTrainer` to it. It reads the run config (as the app does); the trainer
library (``rollpoint.trainer``) never imports it, and it imports only public names (the
façade, the trainer library's ``__all__``, the protocol): a test enforces both.

Its names are imported on first use (PEP 562): the job takes :class:`SimulatedTrainer` as
its default update without loading the façade the loop runs on, which runs the job.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollpoint.loop.builtin_run import run_builtin
    from rollpoint.loop.simulated_trainer import SimulatedTrainer

__all__ = ["SimulatedTrainer", "run_builtin"]

_HOMES = {
    "SimulatedTrainer": "rollpoint.loop.simulated_trainer",
    "run_builtin": "rollpoint.loop.builtin_run",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'rollpoint.loop' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
