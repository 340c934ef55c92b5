"""What tests in several folders share: process groups and their worker, object-store emulators,
fixtures of checkpoints, a small Flax model, resident-memory readings."""
