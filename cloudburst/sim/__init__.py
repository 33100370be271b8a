"""The virtual cluster: ``cloudburst simulate`` runs a whole job in one process on a
deterministic discrete-event clock (``clock``: what each step, message, collective and server
apply costs in virtual seconds; ``sweep``: many simulated runs, one table and plots).
"""
