"""`python -m x1_pretrain.finish`: the command's name, kept; the code is x1_pretrain.run.finish."""

import sys

from x1_pretrain.run.finish import main

if __name__ == "__main__":
    sys.exit(main())
