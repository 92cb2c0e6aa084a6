"""rollpoint's own step record: ``train_data.jsonl``, ``checkpoints/`` and the
:class:`~rollpoint.trainer.record.workdir_record.WorkdirRecord` over both.

These are the built-in loop's pieces, yet they stay in the trainer library and do not move
to :mod:`rollpoint.loop`: the record is the default :class:`~rollpoint.trainer.StepRecord`
of the façade and of :func:`~rollpoint.job.run.run_job` (a run resumes from it), and the
trainer's restore and train hooks read train checkpoints. The loop is built on the façade,
and the trainer library never imports the loop: in ``loop/`` they would make an arrow run
back up.
"""
