"""`python -m x1_pretrain.demo`: the command's name, kept; the code is x1_pretrain.stack.demo."""

import sys

from x1_pretrain.stack.demo import main

if __name__ == "__main__":
    sys.exit(main())
