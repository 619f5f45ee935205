"""puma.train."""
