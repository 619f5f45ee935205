"""puma.data."""
