"""The lease-manager: turns reservations into fenced leases and ends them cleanly."""
