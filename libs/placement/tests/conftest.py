"""Fixtures: the real trace and a reduced slice of it (shared with the replay's tests)."""

from tests.trace_fixtures import small_nodes, small_pods, small_trace, trace_dir

__all__ = ["small_nodes", "small_pods", "small_trace", "trace_dir"]
