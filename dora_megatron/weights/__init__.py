"""weights package."""
