"""`python -m x1_pretrain.sample`: the command's name, kept; the code is x1_pretrain.run.sample."""

import sys

from x1_pretrain.run.sample import main

if __name__ == "__main__":
    sys.exit(main())
