"""Baseline FL systems for comparison runs (the LIFL paper's SF, SF-micro and SL)."""
