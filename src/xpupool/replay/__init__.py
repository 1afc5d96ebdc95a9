"""The trace replay: how placement policies, and the scheduler itself, do on a real trace.

It reads the Alibaba GPU trace v2023 (``trace``), builds the FGD protocol's arrival sequence
and scores placements (``arrivals``), samples workload variants (``variants``), turns pods into
job requests (``requests``), replays through the scheduler's own ``decide`` as the service wires
it (``scheduler_default``) or through the running services (``live``), and is the
``xpupool replay`` command (``cli``). Nothing below it (placement, the services) imports it.
"""
