"""The idem_middleware example app (see docs/example-app.md)."""
