"""`stalwart serve`: the inference engine behind an OpenAI-compatible HTTP API, partitioned and replicated."""
