"""`python -m x1_pretrain.stack`: the process runner's command."""

import sys

from x1_pretrain.stack.runner import main

sys.exit(main())
