"""The Textual operator console (imports no torch)."""
