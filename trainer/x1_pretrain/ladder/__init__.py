"""The scaling ladder: small runs of the run's own model family, on its GPU, data and tokenizer,
planned against the dollar cap, fitted into a law that predicts the run's final val loss with a
measured tolerance (docs/SCALING.md).

    family.py   the rungs' models and training settings, scaled from the run's config
    plan.py     which rungs, at what cost (`ladder plan`)
    run.py      the rungs trained by the trainer, several at once, resumable (`ladder run`)
    fit.py      the law fitted as the Chinchilla replication did (`ladder fit`)
    report.py   ladder.png and ladder.md (`ladder report`)
    cli.py      the command line: python -m x1_pretrain.ladder plan|run|fit|predict|report

This package sits above run/ and train/ (it drives the trainer); nothing below imports it. What
plan, the trainer and dod read of a ladder is x1_common.scaling: the law in closed form.
"""
