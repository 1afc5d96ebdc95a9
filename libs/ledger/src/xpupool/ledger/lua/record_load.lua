-- Record live load for many devices (telemetry, not a capacity change; see record_samples).
-- ARGV: device_id, util ('' = unknown), mem_used ('' = unknown), repeated.
record_samples(ARGV, 1, now_ms())
return cjson.encode({ok = true})
