"""The seven-axis load picture (pure: no Faust, no Kafka, no clock reads)."""
