"""Local Apache Kafka (KRaft, single node) for development, tests and the demo."""
