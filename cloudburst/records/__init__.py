"""What a run leaves on disk: its run directory (:mod:`.rundir`), the per-rank metrics
(:mod:`.metrics`), checkpoint files (:mod:`.checkpoint`) and the workers' checkpoints a resumed
run starts from (:mod:`.resilience`).

A face only: importing a submodule pulls in nothing else of the package.
"""
