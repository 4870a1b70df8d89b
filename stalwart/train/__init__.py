"""The training loop and what it is made of (init, optimizer, schedule, launcher)."""
