"""``python -m cloudburst``.

``python -m`` puts the current directory first on the import path; cloudburst removes it, so
that a run never imports a module that happens to lie where it was started (``cd shared_run &&
python -m cloudburst train --resume .`` must not run an ``evil.py`` left there). Code runs only
when named on the command line (``--model package.module:function``), found on ``PYTHONPATH``
or among the installed packages — ``PYTHONPATH=.`` opts the current directory in.
"""

import os
import sys

if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]  # PYTHONPATH's own entries (".", say) come after it and stay

# A local job's ranks fork from a forkserver that imports torch and the training code; the CLI
# imports torch too (cloudburst.cli -> resilience). Started here, before that import, the two
# run side by side on two cores (~1.3 s less per job on the 2-core machine) instead of one after
# the other (cmd_train/cmd_compare/demo's own start_forkserver() then finds it running).
if (
    len(sys.argv) > 1
    and sys.argv[1] in ("train", "compare", "demo")
    and not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))  # not torchrun
):
    from cloudburst.forkserver import start_forkserver  # imports no torch

    start_forkserver()

from cloudburst.cli import main  # noqa: E402

sys.exit(main())
