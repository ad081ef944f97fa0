"""`python -m x1_pretrain.prepare`: the command's name, kept; the code is x1_pretrain.data.prepare."""

import sys

from x1_pretrain.data.prepare import main

if __name__ == "__main__":
    sys.exit(main())
