"""The autoscaler: grows and shrinks operator-configured node pools from pending demand and cost.

Pure parts (no I/O): ``pools`` (the pool file), ``scale_down`` (drain and removal with cool-down
and hysteresis), ``forecast`` (predictive demand), ``decisions`` (the plan and its events),
``solver`` (the interface the placement-backed scale-up solver implements). ``providers`` add
and remove nodes: ``exec``, ``kubernetes``, ``simulated``.

The service: ``main`` (``python -m xpupool.autoscaler``: NATS, the ledger, providers, metrics),
``loop`` (the decision cycle of the acting replica), ``state`` (its leader lease with a fencing
term, the journal of decided steps, pool node records, in the ledger's Redis), ``drain``
(``NodeDrainer``), ``status`` (what ``xpupool scale status`` shows), ``metrics``.
"""
