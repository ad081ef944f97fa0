"""`python -m x1_pretrain.corpus`: the command's name, kept; the code is x1_pretrain.data.corpus."""

import sys

from x1_pretrain.data.corpus import main

if __name__ == "__main__":
    sys.exit(main())
