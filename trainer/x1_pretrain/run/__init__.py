"""The run-folder tools, run after (or beside) training: plan, export, post-mortem, dod, sample."""
