"""The idem_middleware example app (see PROTOCOL §7 and the README)."""
