"""What every layer may use: stopping a background task, the optional extras, import paths.

Each module imports nothing of rollpoint but the protocol's errors, so the SDK, the servers,
the trainer library and the app can all import it without an arrow running back up.
"""
