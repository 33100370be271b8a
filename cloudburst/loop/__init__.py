"""A rank's life, the same on a real rank (:mod:`cloudburst.train`), a virtual one
(:mod:`cloudburst.sim.run`) and, for its components, in a user's loop (:class:`cloudburst.api.Job`).

- :mod:`.role`: ``run_role``, the one rank main; ``run_worker``, the training loop's driver;
  ``run_server``.
- :mod:`.train_step`: ``TrainStep``, the one optimizer step (the loop's, the warm start's and
  the simulator's calibration), with its optimizer, schedule and clipping.
- :mod:`.step`: the step clock (the emulated device's time), the strategy's after-step
  call, the progress bar.
- :mod:`.faults`: this worker's injected faults.
- :mod:`.checkpointer`: resume from, and save, a worker's checkpoints.
- :mod:`.evaluator`: the global model's periodic evaluation, off the clock.
- :mod:`.budget`: ``--max-train-time-s``, and the lockstep workers' agreement on the step
  that ends it.
- :mod:`.finish`: the strategy's finish and a worker's report, the final model, the
  hand-in to rank 0; a server's shard served to the end.
- :mod:`.summary`: a run's ``summary.json`` and the table the CLI prints of it.
"""
