"""Specimen events: one valid template per event type, and one bad record per dead-letter category.

Used by the demo (so a user sees the dead-letter path work), by the tests,
and as the one place a schema change has to touch.
"""

import uuid

import orjson


def request_event(**changes) -> dict:
    event = {"schema_version": 1, "event_id": str(uuid.uuid4()), "event_time": 1_700_158_546_680,
             "task_id": "task-1", "request_id": "task-1-r1", "attempt": 1, "task_final": True,
             "tenant": "acme", "priority": "standard", "pool": "llama-70b-a",
             "model": "meta-llama/Llama-3.1-70B-Instruct", "phase": "completed", "replica_id": "r1",
             "input_tokens": 1000, "cached_input_tokens": 0, "output_tokens": 100, "queue_s": 0.01,
             "ttft_s": 0.3, "tpot_s": 0.03, "duration_s": 3.3, "slo_ttft_s": 1.0, "slo_tpot_s": 0.1}
    event.update(changes)
    return event


def replica_sample(**changes) -> dict:
    sample = {"schema_version": 1, "event_id": str(uuid.uuid4()), "event_time": 1_700_158_547_000,
              "replica_id": "r1", "pool": "llama-70b-a", "hardware": "H100-80GB", "gpu_count": 4,
              "requests_running": 10, "requests_waiting": 2, "kv_cache_usage": 0.5, "preemptions_total": 0,
              "prompt_tokens_total": 1000, "generation_tokens_total": 500, "prefix_cache_hits_total": 10,
              "prefix_cache_queries_total": 20, "healthy": True}
    sample.update(changes)
    return sample


def bad_inputs(max_bytes: int) -> list[tuple[str, bytes | None, bytes | None]]:
    """(expected reason, value, key) for every bad-input category the ingest must dead-letter."""
    ok = request_event()
    dumps = orjson.dumps
    missing = dict(ok)
    del missing["pool"]
    return [
        ("malformed_json", b'{"schema_version": 1, "event_id": ', b"task-1"),
        ("not_object", b"[1, 2, 3]", b"task-1"),
        ("not_object", b'"just a string"', b"task-1"),
        ("wrong_type", dumps(request_event(input_tokens="12")), b"task-1"),
        ("missing_field", dumps(missing), b"task-1"),
        ("out_of_range", dumps(request_event(output_tokens=-3)), b"task-1"),
        ("non_finite_number", dumps(ok).replace(b'"ttft_s":0.3', b'"ttft_s":NaN'), b"task-1"),
        ("non_finite_number", dumps(ok).replace(b'"ttft_s":0.3', b'"ttft_s":Infinity'), b"task-1"),
        # "NaN" in a string is no number: a missing value beside it is malformed JSON (it was read as NaN)
        ("malformed_json", dumps(request_event(task_id="NaN-1")).replace(b'"ttft_s":0.3', b'"ttft_s":'),
         b"task-1"),
        ("unknown_enum", dumps(request_event(phase="exploded")), b"task-1"),
        ("unknown_enum", dumps(request_event(priority="platinum")), b"task-1"),
        ("too_long", dumps(request_event(tenant="x" * 65)), b"task-1"),
        ("oversize", dumps(request_event(model="m" * 100)) + b" " * (max_bytes + 1), b"task-1"),
        ("unknown_schema_version", dumps(request_event(schema_version=7)), b"task-1"),
        ("not_utf8", b'{"schema_version": 1, "tenant": "\xff\xfe"}', b"task-1"),
        ("null_key", dumps(ok), None),
        ("bad_format", dumps(request_event(pool="pool\u202e\u0007evil")), b"task-1"),
        ("unknown_field", dumps(request_event(**{"<script>": 1})), b"task-1"),
        ("key_mismatch", dumps(ok), b"another-task"),
    ]
