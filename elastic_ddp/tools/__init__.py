"""`elastic-ddp report / inspect / chaos` and what they print or draw; the configuration reference."""
