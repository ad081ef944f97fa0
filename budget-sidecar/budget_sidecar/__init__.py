"""X1 budget sidecar: polls the cloud's billing-relevant API and keeps budget.json current.

    python -m budget_sidecar                 the sidecar (settings.py, ledger.py, poller.py, app.py)
    python -m budget_sidecar.price           the lab's max-price rule before launch
    python -m budget_sidecar.fake_billing    a fake Lambda / RunPod API for tests and the demo
"""
