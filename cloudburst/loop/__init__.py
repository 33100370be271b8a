"""The training loop's components, around :func:`cloudburst.train.run_worker` (the driver)
and shared with :class:`cloudburst.api.Job` (a user's loop).

- :mod:`.step`: the step clock (the emulated device's time), the strategy's after-step
  call, the progress bar.
- :mod:`.faults`: this worker's injected faults.
- :mod:`.checkpointer`: resume from, and save, a worker's checkpoints.
- :mod:`.evaluator`: the global model's periodic evaluation, off the clock.
- :mod:`.budget`: ``--max-train-time-s``, and the lockstep workers' agreement on the step
  that ends it.
- :mod:`.finish`: the strategy's finish and a worker's report, the final model, the
  hand-in to rank 0; a server's shard served to the end.
"""
