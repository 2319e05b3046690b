"""What every tool of bench/ shares: where results go and what a recorded result carries (record.py)."""
