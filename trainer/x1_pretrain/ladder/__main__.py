import sys

from x1_pretrain.ladder.cli import main

sys.exit(main())
