"""`python -m x1_pretrain.plan`: the command's name, kept; the code is x1_pretrain.run.plan."""

import sys

from x1_pretrain.run.plan import main

if __name__ == "__main__":
    sys.exit(main())
