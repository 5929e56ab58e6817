-- Where landing resumes is decided by which source offsets the store holds
-- (pipeline/sinks/positions.py), not by block boundaries or the deduplication
-- window: a per-granule min/max of source_offset lets that lookup read only the
-- parts of the partition's newest blocks (each insert is one source partition's
-- run of offsets, so its granules' ranges are narrow).

ALTER TABLE request_events ADD INDEX IF NOT EXISTS source_offset_minmax source_offset TYPE minmax GRANULARITY 1;
ALTER TABLE replica_samples ADD INDEX IF NOT EXISTS source_offset_minmax source_offset TYPE minmax GRANULARITY 1;
ALTER TABLE admission_signals ADD INDEX IF NOT EXISTS source_offset_minmax source_offset TYPE minmax GRANULARITY 1;
