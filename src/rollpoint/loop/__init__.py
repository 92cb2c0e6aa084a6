"""The built-in loop: ``rollpoint run``'s trainer, built on the trainer's façade only.

It is what a trainer of your own would be, with a simulated update: :func:`run_builtin`
opens :class:`rollpoint.Rollouts`, pulls each batch and applies
:class:`SimulatedTrainer` to it. It reads the run config (as the app does); the trainer
library (``rollpoint.trainer``) never imports it, and it imports only public names (the
façade, the trainer library's ``__all__``, the protocol): a test enforces both. The job
(:func:`rollpoint.job.run.run_job`) takes its hooks from its caller and imports nothing of
it, so its names are plain imports.
"""

from rollpoint.loop.builtin_run import run_builtin
from rollpoint.loop.simulated_trainer import SimulatedTrainer

__all__ = ["SimulatedTrainer", "run_builtin"]
