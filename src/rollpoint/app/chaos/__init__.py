"""``rollpoint chaos``: randomized fault trials of whole runs, each checked against the invariants.

:mod:`~rollpoint.app.chaos.plan` draws the trials, :mod:`~rollpoint.app.chaos.trial` runs one
in its own process (its faults :mod:`~rollpoint.app.chaos.trial_faults`, its output
:mod:`~rollpoint.app.chaos.trial_output`), :mod:`~rollpoint.app.chaos.tally` sums the verdicts
and :mod:`~rollpoint.app.chaos.command` runs the campaign (a trial process from outside
:mod:`~rollpoint.app.chaos.launch`, its store watched :mod:`~rollpoint.app.chaos.store_watch`,
the faults between runs :mod:`~rollpoint.app.chaos.between_runs`). It uses the shipped test kit
(:mod:`rollpoint.testing`: fault proxies, invariants) and the job; the kit imports none of it.
"""
