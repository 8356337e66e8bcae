"""Differential fuzzing of the graph pass and the op (see FUZZING.md)."""
