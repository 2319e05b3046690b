"""The public calls, re-exported from the package root."""
