import sys

from ninfer_numba.cli import main

sys.exit(main())
