"""Training: state, optimizer, losses, the jitted step, the loop, metrics."""
