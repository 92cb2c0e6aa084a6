"""``rollpoint chaos``: randomized fault trials of whole runs, each checked against the invariants.

:mod:`~rollpoint.app.chaos.plan` draws the trials, :mod:`~rollpoint.app.chaos.trial` runs one
in its own process, :mod:`~rollpoint.app.chaos.tally` sums the verdicts and
:mod:`~rollpoint.app.chaos.command` runs the campaign. It uses the shipped test kit
(:mod:`rollpoint.testing`: fault proxies, invariants) and the job; the kit imports none of it.
"""
