"""The whole stack as local processes (`python -m x1_pretrain.stack`), its service definitions, the demo."""
