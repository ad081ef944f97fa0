"""`x1`: one command from a laptop to a finished run folder on disk (launch, status, logs, fetch, down)."""
