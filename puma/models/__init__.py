"""puma.models."""
