"""Primitives under everything else: the engine thread class, OpenMP teams, errors, nested-argument trees."""
