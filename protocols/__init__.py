"""protocols (see DESIGN.md)."""
