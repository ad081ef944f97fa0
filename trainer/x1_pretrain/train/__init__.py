"""The trainer (`python -m x1_pretrain.train`): the loop in loop.py and the components it calls."""
