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

# A local job's ranks fork from a forkserver that train/compare/demo fork from this process once
# it has imported torch (cloudburst.forkserver): torch is imported once per job, not twice.
from cloudburst.cli import main  # noqa: E402

sys.exit(main())
