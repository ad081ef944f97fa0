"""`python -m x1_pretrain.dod`: the command's name, kept; the code is x1_pretrain.run.dod."""

import sys

from x1_pretrain.run.dod import main

if __name__ == "__main__":
    sys.exit(main())
