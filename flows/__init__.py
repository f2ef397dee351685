"""Prefect flows: `tune` (one study end to end) and `retune` (the nightly Hub check); prefect.yaml deploys them."""
