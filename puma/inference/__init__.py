"""puma.inference."""
