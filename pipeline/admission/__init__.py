"""Admission and shedding (pure): the policy, the signal, and its signature."""
