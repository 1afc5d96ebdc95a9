"""The scheduler: validates job requests, places them and commits reservations to the ledger."""
