"""Acceptance evaluation through the speculative inference path: prompts, runs, reports, plots, comparisons."""
