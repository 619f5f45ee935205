"""puma.index."""
