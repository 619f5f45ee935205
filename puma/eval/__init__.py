"""puma.eval."""
