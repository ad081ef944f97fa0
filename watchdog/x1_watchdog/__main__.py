import sys

from x1_watchdog.cli import main

sys.exit(main())
