"""`python -m x1_pretrain.postmortem`: the command's name, kept; the code is x1_pretrain.run.postmortem."""

import sys

from x1_pretrain.run.postmortem import main

if __name__ == "__main__":
    sys.exit(main())
