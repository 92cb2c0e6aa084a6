"""The app: the ``rollpoint`` command and what only it does.

The CLI (:mod:`~rollpoint.app.cli`), the run config its YAML is read into
(:mod:`~rollpoint.app.config`), the snapshot listing (:mod:`~rollpoint.app.snapshot_report`)
and its table helper, the HTML run report (:mod:`rollpoint.app.report`) and the
``rollpoint chaos`` runner (:mod:`rollpoint.app.chaos`). The app stands on top: it imports
the libraries below it (the job, the trainer, the façade, the runtimes, the store, the test
kit), and none of them imports it.
"""
