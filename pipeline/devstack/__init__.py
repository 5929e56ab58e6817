"""Local Apache Kafka (KRaft: one node, or a replicated cluster, plaintext or SASL_SSL with ACLs) for
development, tests and the demo."""
