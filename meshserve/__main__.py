import sys

from meshserve.cli import main

sys.exit(main())
