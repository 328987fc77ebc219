"""The torch reference backend (backend.py) and its attention (attention.py)."""
