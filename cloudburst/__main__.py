import sys

from cloudburst.cli import main

sys.exit(main())
