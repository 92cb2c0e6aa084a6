"""The job: one training run assembled, from its settings to its summary.

What ``rollpoint run``, the :class:`~rollpoint.rollouts.Rollouts` façade and chaos trials
all run underneath: :func:`~rollpoint.job.run.run_job` locks the workdir, picks the
snapshot to resume from, checks the workdir and the store (:mod:`~rollpoint.job.start_checks`),
starts the servers and checks what they serve (:mod:`~rollpoint.job.deployment_check`),
restores (:mod:`~rollpoint.job.journal_status` asks the journals what is left), runs the
trainer and stops everything on every exit path; a run that already ended is known from
its record (:mod:`~rollpoint.job.finished_run`).

The job sits below the app and above the libraries: it imports the trainer, the runtimes
and the store, and neither the app nor the built-in loop; the app and the façade drive it.
"""
