"""Sluice inside gateways people already run (LiteLLM proxy: ``pipeline.integrations.litellm``)."""
