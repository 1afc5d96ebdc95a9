"""The telemetry-collector: one per node; keeps the ledger's view of the node's devices true."""
