"""Run records (metrics.jsonl, events.jsonl), MFU, and the progress display."""
