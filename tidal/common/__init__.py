"""Neutral building blocks that every layer may import (they import nothing of the project)."""
