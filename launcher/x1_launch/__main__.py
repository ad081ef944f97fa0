import sys

from x1_launch.cli import main

sys.exit(main())
