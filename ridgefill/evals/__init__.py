"""Evaluation task generators and scorers (RULER and friends), independent of any model runtime."""
