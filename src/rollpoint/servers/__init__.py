"""The built-in servers, each its own package: ``model``, ``agent`` and ``resources``; the app
factory with the lifespan and control plane they share is :mod:`~rollpoint.servers.server_app`.

Each is built only on the participant SDK (:mod:`rollpoint.participant`, imported through
the package, never its private modules) and the protocol; none imports the trainer, the
app (cli, job) or the built-in training loop (a test reads their imports).
"""
