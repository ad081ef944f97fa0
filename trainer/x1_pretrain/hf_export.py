"""`python -m x1_pretrain.hf_export`: the command's name, kept; the code is x1_pretrain.run.hf_export."""

import sys

from x1_pretrain.run.hf_export import main

if __name__ == "__main__":
    sys.exit(main())
