"""Barrel command-line client."""
