"""X1 trainer: data, model, the training loop, and the run's artifacts, by layer (docs/DESIGN.md §2).

Each layer imports only from itself and the layers below (pyproject.toml [tool.importlinter]):

    stack/       the whole stack as local processes, its service definitions, the demo
    run/         the run-folder tools: plan, export, post-mortem, dod, finish, hf_export, sample
    train/       the trainer: loop.py (the loop and the step), setup, resume, parser, its components
    data/        tokenizer, corpus, tokenizing, the token-file loader   | checkpoint/  weights file, store, load
    model/       the transformer
    ops/         GPU operations: Triton kernels, cuBLASLt, float8, fused losses, levers
    config.py    the typed run config

The other modules here are the commands' names, kept: `python -m x1_pretrain.tokenize_data`,
`.export_run`, `.plan`, ... each a few lines that run the command from its layer. `train` and
`stack` are packages with a `__main__`.
"""
