"""`python -m x1_pretrain.tokenize_data`: the command's name, kept; the code is x1_pretrain.data.tokenize."""

import sys

from x1_pretrain.data.tokenize import main

if __name__ == "__main__":
    sys.exit(main())
