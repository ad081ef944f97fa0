"""`python -m x1_pretrain.export_run`: the command's name, kept; the code is x1_pretrain.run.export."""

import sys

from x1_pretrain.run.export import main

if __name__ == "__main__":
    sys.exit(main())
