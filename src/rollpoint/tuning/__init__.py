"""Performance tricks, each kept in one module and named by the bench item that pays for it.

- :mod:`~rollpoint.tuning.collector_pause`: the cyclic garbage collector paused while a
  large document is decoded or a checkpoint holds a process (``snapshot_io``, ``snapshot_pause``);
- :mod:`~rollpoint.tuning.collector_schedule`: full collections run right after a
  checkpoint's pause, not when CPython's thresholds say (``snapshot_pause_100k``);
- :mod:`~rollpoint.tuning.deferred_value`: a record value made when it is written, not
  inside the pause (``snapshot_pause``);
- :mod:`~rollpoint.tuning.encoded_json`: JSON encoded once and kept as a fragment a writer
  copies (``snapshot_io``).

None of them changes what is computed or written: turn one off and every test still
passes, only slower (the bench item says how much). :mod:`rollpoint.store` knows files;
these know the interpreter.
"""
