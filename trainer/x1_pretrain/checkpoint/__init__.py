"""What a checkpoint is on disk (the weights file format) and the store that writes and finds them."""
