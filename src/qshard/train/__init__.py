"""The training loop and what it needs: optimizer, schedule, loss, metrics."""
