"""Placeholder until this family is written."""
