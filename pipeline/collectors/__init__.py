"""GPU-side collectors: scrape serving engines' Prometheus endpoints, publish ReplicaSamples."""
