"""Drafter modules: each model in one readable file, with its config and save/load."""
