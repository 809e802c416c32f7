"""The wire contract between the API and the workers (no torch: `api` imports only this package)."""
