"""OpenTelemetry in: GenAI spans exported by an OpenTelemetry Collector to Kafka → RequestEvents.

spans.py   pure: one OTLP/JSON ExportTraceServiceRequest (bytes) → RequestEvents, rejections, skips
bridge.py  the shell: the OTLP topic → the requests topic and dead letters (``sluice otel-bridge``)

The mapping is documented in docs/integrations.md.
"""
