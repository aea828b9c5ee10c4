import sys

from plexus.cli import main

sys.exit(main())
