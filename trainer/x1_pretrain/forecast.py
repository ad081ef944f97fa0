"""`python -m x1_pretrain.forecast`: the command's name, kept; the code is x1_pretrain.train.forecast_calibration."""

import sys

from x1_pretrain.train.forecast_calibration import main

if __name__ == "__main__":
    sys.exit(main())
