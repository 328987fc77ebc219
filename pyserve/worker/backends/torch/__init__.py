"""The torch reference backend and its attention (attention.py)."""
